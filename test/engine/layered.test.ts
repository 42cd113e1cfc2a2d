// Layered transfer requests (makeLayeredXfer / postLayer), on every engine:
// each layer's bytes, one completion and one notification per posting (after
// every byte), re-posting, release, and every misuse answered with a code.
// NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { expect, it } from 'vitest';
import { DescList, type LayeredXferHandle, NixlAgent, NixlError, allocate } from '../../lib';
import { Peer, eachEngine, preparedBlocks } from '../helpers';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const { setupAgent } = require('../fixtures/conformance-setup');

const BLOCK = 4096;
const LAYERS = 4;
const PER_LAYER = 3;
const N = LAYERS * PER_LAYER;

/** Block b of memory filled by `seed`: every block of every seed differs. */
const mark = (seed: number, b: number): number => (seed * 37 + b * 11 + 1) & 0xff;
function fill(mem: Buffer, seed: number): void {
  for (let b = 0; b < N; b++) mem.fill(mark(seed, b), b * BLOCK, (b + 1) * BLOCK);
}
/** The block numbers of `mem` that do not hold exactly `want(b)` in every byte. */
function wrongBlocks(mem: Buffer, want: (b: number) => number, blocks: number[]): number[] {
  return blocks.filter((b) => mem.subarray(b * BLOCK, (b + 1) * BLOCK).some((x) => x !== want(b)));
}
/** Local block i <- remote block perm[i]: scattered, so no two descriptors merge. */
const perm = Array.from({ length: N }, (_, i) => (i * 5 + 7) % N);
const localLayers = Array.from({ length: LAYERS }, (_, l) =>
  Array.from({ length: PER_LAYER }, (_, k) => l + LAYERS * k),
);
const remoteLayers = localLayers.map((idx) => Uint32Array.from(idx, (i) => perm[i]));
const ALL = Array.from({ length: N }, (_, i) => i);
const blocksOf = (l: number): number[] => localLayers[l];

const turns = async (n: number): Promise<void> => {
  for (let i = 0; i < n; i++) await new Promise((r) => setTimeout(r, 2));
};
const codeOf = (f: () => unknown): string | undefined => {
  try {
    f();
  } catch (e) {
    return (e as NixlError).code;
  }
  return undefined;
};

eachEngine('layered transfers: %s engine', (engine, open) => {
  /** a pulls from / pushes to b; both hold N blocks; lists of every block prepared on a. */
  function setup(opts: { testDelayUs?: number } = {}) {
    const a: NixlAgent =
      opts.testDelayUs === undefined
        ? setupAgent(NixlAgent, 'lay-a', engine)
        : new NixlAgent('lay-a', { engine: 'loopback', testDelayUs: opts.testDelayUs });
    const b: NixlAgent = setupAgent(NixlAgent, 'lay-b', engine);
    open.push(a, b);
    const { ma, mb, local, remote } = preparedBlocks(a, b, N, BLOCK);
    const layered = (op: 'READ' | 'WRITE', notif?: string): LayeredXferHandle =>
      a.makeLayeredXfer(op, local, localLayers, remote, remoteLayers, notif);
    return { a, b, ma, mb, local, remote, layered };
  }

  it('READ: every layer lands in its scattered blocks, and the request completes only after the last layer', async () => {
    const { a, ma, mb, layered } = setup();
    fill(mb, 1);
    fill(ma, 2);
    const h = layered('READ');
    expect(h.layers).toBe(LAYERS);
    expect(codeOf(() => a.checkXferState(h))).toBe('NIXL_ERR_NOT_POSTED');
    expect(a.postLayer(h, 0)).toBe('PROC');
    // Waiting before the last layer is posted: settled only once it is done.
    const waited = a.wait(h).then(() => 'done');
    let settled: string | undefined;
    void waited.then((v) => {
      settled = v;
    });
    for (let l = 1; l < LAYERS - 1; l++) {
      expect(a.postLayer(h, l)).toBe('PROC');
      await turns(3);
    }
    // Every posted layer has moved its bytes, the unposted one none of them.
    for (let l = 0; l < LAYERS - 1; l++) expect(wrongBlocks(ma, (i) => mark(1, perm[i]), blocksOf(l))).toEqual([]);
    expect(wrongBlocks(ma, (i) => mark(2, i), blocksOf(LAYERS - 1))).toEqual([]);
    expect(a.checkXferState(h)).toBe('PROC');
    await turns(5);
    expect(settled).toBeUndefined();
    a.postLayer(h, LAYERS - 1);
    expect(await waited).toBe('done');
    expect(a.checkXferState(h)).toBe('DONE');

    expect(wrongBlocks(ma, (i) => mark(1, perm[i]), ALL)).toEqual([]);
    a.releaseXferHandle(h);
  });

  it('WRITE: one notification per posting, sent after every layer is in place; re-posting moves the new bytes', async () => {
    const { a, b, ma, mb, layered } = setup();
    const h = layered('WRITE', 'kv-ready');
    const want = (seed: number) => (i: number) => mark(seed, perm.indexOf(i));

    for (const seed of [3, 4]) {
      fill(ma, seed);
      for (let l = 0; l < LAYERS - 1; l++) a.postLayer(h, l);
      await turns(10);
      expect(b.getNewNotifs().get('lay-a')).toBeUndefined();
      a.postLayer(h, LAYERS - 1);
      const n = await b.waitForNotif({ agent: 'lay-a' }, { timeoutMs: 10_000 });
      // Seen by the peer: every byte of every layer is already there.
      expect(wrongBlocks(mb, want(seed), ALL)).toEqual([]);
      expect(n.msg.toString()).toBe('kv-ready');
      await a.wait(h, { timeoutMs: 10_000 });
      await turns(10);
      expect(b.getNewNotifs().get('lay-a')).toBeUndefined();
    }
    a.releaseXferHandle(h);
  });

  it('transfer() posts every layer not yet posted; postLayer starts the next posting once all are done', async () => {
    const { a, ma, mb, layered } = setup();
    fill(mb, 5);
    const h = layered('READ');
    a.postLayer(h, 2);
    a.transfer(h);
    await a.wait(h, { timeoutMs: 10_000 });
    expect(wrongBlocks(ma, (i) => mark(5, perm[i]), ALL)).toEqual([]);
    fill(mb, 6);
    a.postLayer(h, 1);
    expect(a.checkXferState(h)).toBe('PROC');
    expect(codeOf(() => a.postLayer(h, 1))).toBe('NIXL_ERR_REPOST_ACTIVE');
    for (const l of [0, 2, 3]) a.postLayer(h, l);
    await a.wait(h, { timeoutMs: 10_000 });
    expect(wrongBlocks(ma, (i) => mark(6, perm[i]), ALL)).toEqual([]);
  });

  it('misuse: a layer out of range or not a number, the same layer twice, unknown ops on the handle', () => {
    const { a, layered } = setup();
    const h = layered('READ');
    expect(codeOf(() => a.postLayer(h, LAYERS))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(() => a.postLayer(h, -1))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(() => a.postLayer(h, 1.5))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(() => a.postLayer(h, '0' as unknown as number))).toBe('NIXL_ERR_INVALID_PARAM');
    a.postLayer(h, 0);
    expect(codeOf(() => a.postLayer(h, 0))).toBe('NIXL_ERR_REPOST_ACTIVE');
    expect(codeOf(() => a.getXferTelemetry(h))).toBe('NIXL_ERR_NOT_SUPPORTED');
  });

  it('misuse at make: empty or mismatched layers, an index out of range', () => {
    const { a, local, remote } = setup();
    const make = (l: number[][], r: number[][]) => () => a.makeLayeredXfer('READ', local, l, remote, r);
    expect(codeOf(make([], []))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(make([[0], []], [[0], []]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(make([[0]], [[0], [0]]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(make([[0, 1]], [[0]]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(make([[0], [1]], [[0], [N]]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(codeOf(make([[0], [1]], [[0], [1]]))).toBeUndefined();
  });

  it('release mid-way: a pending wait rejects NIXL_ERR_CANCELED, and the handle is gone', async () => {
    const { a, layered } = setup();
    const h = layered('READ');
    a.postLayer(h, 0);
    const w = a.wait(h);
    a.releaseXferHandle(h);
    await expect(w).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
    expect(codeOf(() => a.postLayer(h, 1))).toBe('NIXL_ERR_NOT_FOUND');
    expect(codeOf(() => a.checkXferState(h))).toBe('NIXL_ERR_NOT_FOUND');
  });

  it('a released handle stays refused once a new request takes its place; a forged id is refused', async () => {
    const { a, ma, mb, layered } = setup();
    fill(mb, 3);
    fill(ma, 4);
    const old = layered('READ');
    a.releaseXferHandle(old);
    // The new request may take the released one's place in the addon's table: the old handle must not reach it.
    const h = layered('READ');
    expect(h.id).not.toBe(old.id);
    expect(codeOf(() => a.postLayer(old, 0))).toBe('NIXL_ERR_NOT_FOUND');
    expect(codeOf(() => a.checkXferState(old))).toBe('NIXL_ERR_NOT_FOUND');
    expect(codeOf(() => a.releaseXferHandle(old))).toBe('NIXL_ERR_NOT_FOUND');
    // Ids next to a live one (another generation of its place, another place) are no handles either.
    for (const id of [h.id + 0x10000, h.id - 0x10000, h.id + 1, (h.id | 0x7fff0000) >>> 0]) {
      const forged = { ...h, id } as LayeredXferHandle;
      expect(
        codeOf(() => a.postLayer(forged, 0)),
        `id 0x${id.toString(16)}`,
      ).toBe('NIXL_ERR_NOT_FOUND');
    }
    expect(codeOf(() => a.checkXferState(h))).toBe('NIXL_ERR_NOT_POSTED');
    for (let l = 0; l < LAYERS; l++) a.postLayer(h, l);
    await a.wait(h);
    expect(wrongBlocks(ma, (i) => mark(3, perm[i]), ALL)).toEqual([]);
    a.releaseXferHandle(h);
  });

  if (engine === 'loopback')
    it('a place whose handles are spent is retired: no handle is ever handed out twice', () => {
      const { a, local, remote } = setup();
      // 32,768 handles per place in the addon's table (layered.h): one more make than that moves to another place.
      const seen = new Set<number>();
      const first = a.makeLayeredXfer('READ', local, [[0]], remote, [[0]]);
      seen.add(first.id);
      a.releaseXferHandle(first);
      for (let i = 0; i < 0x8000; i++) {
        const h = a.makeLayeredXfer('READ', local, [[0]], remote, [[0]]);
        if (seen.has(h.id)) throw new Error(`handle 0x${h.id.toString(16)} handed out twice (make ${i})`);
        seen.add(h.id);
        a.releaseXferHandle(h);
      }
      expect(codeOf(() => a.postLayer(first, 0))).toBe('NIXL_ERR_NOT_FOUND');
    });

  it("an engine error on one layer makes the whole request ERR; the posting's remaining layers move nothing", async () => {
    const { a, ma, mb, layered } = setup();
    fill(mb, 7);
    fill(ma, 8);
    const h = layered('READ');
    a.postLayer(h, 0);
    await a.waitForNotif(() => false, { timeoutMs: 20 }).catch(() => {});
    a.removeRemoteAgent('lay-b');
    const w = a.wait(h);
    expect(a.postLayer(h, 1)).toBe('ERR');
    await expect(w).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_FOUND' });
    expect(a.getXferError(h)?.message).toMatch(/layer 1/);
    expect(a.postLayer(h, 2)).toBe('ERR');
    expect(a.postLayer(h, 3)).toBe('ERR');
    expect(wrongBlocks(ma, (i) => mark(8, i), [...blocksOf(1), ...blocksOf(2), ...blocksOf(3)])).toEqual([]);
    // Every layer called: the next postLayer starts a new posting (which fails again: the peer is gone).
    expect(a.postLayer(h, 0)).toBe('ERR');
    expect(a.getXferError(h)).toBeInstanceOf(NixlError);
  });

  if (engine === 'loopback') {
    it('a new posting while layers of the last are still in flight is refused', async () => {
      const { a, layered } = setup({ testDelayUs: 30_000 });
      const h = layered('READ');
      for (let l = 0; l < LAYERS; l++) expect(a.postLayer(h, l)).toBe('PROC');
      expect(codeOf(() => a.postLayer(h, 0))).toBe('NIXL_ERR_REPOST_ACTIVE');
      await a.wait(h, { timeoutMs: 10_000 });
      expect(a.postLayer(h, 0)).toBe('PROC');
      await expect(a.wait(h, { timeoutMs: 100 })).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
    });

    /** A loopback agent and a layered READ of the blocks of a peer process (its memory mapped here). */
    async function withChildPeer(peer: Peer) {
      const a = new NixlAgent('lay-parent', { engine: 'loopback' });
      open.push(a);
      const ma = allocate(N * BLOCK);
      a.registerMemory(ma);
      const init = await peer.initAgent({ name: 'lay-child', size: N * BLOCK, shared: true, seed: 2 });
      a.addRemoteAgent(Buffer.from(init.md));
      const blocks = (base: bigint) =>
        DescList.from(Array.from({ length: N }, (_, i) => ({ addr: base + BigInt(i * BLOCK), len: BLOCK })));
      const local = a.prepXferDlist('', blocks(DescList.from(ma).addr(0)));
      const remote = a.prepXferDlist('lay-child', blocks(init.addr));
      return { a, h: a.makeLayeredXfer('READ', local, localLayers, remote, remoteLayers) };
    }

    it('a peer process gone mid-way fails the request with NIXL_ERR_REMOTE_DISCONNECT', async () => {
      const peer = new Peer('peer.js');
      try {
        const { a, h } = await withChildPeer(peer);
        a.postLayer(h, 0);
        peer.kill();
        await peer.exit();
        const w = a.wait(h);
        for (let l = 1; l < LAYERS; l++) a.postLayer(h, l);
        await expect(w).rejects.toMatchObject({ code: 'NIXL_ERR_REMOTE_DISCONNECT' });
      } finally {
        peer.kill();
      }
    });

    it('a peer process gone before the first layer fails the posting with NIXL_ERR_REMOTE_DISCONNECT, though its memory stays mapped here', async () => {
      const peer = new Peer('peer.js');
      try {
        const { a, h } = await withChildPeer(peer);
        peer.kill();
        await peer.exit();
        a.postLayer(h, 0);
        const w = a.wait(h);
        for (let l = 1; l < LAYERS; l++) a.postLayer(h, l);
        await expect(w).rejects.toMatchObject({ code: 'NIXL_ERR_REMOTE_DISCONNECT' });
      } finally {
        peer.kill();
      }
    });
  }
});
