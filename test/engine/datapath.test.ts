// Defects of the data path found by trying to break it (issue 9): each case
// failed (stale bytes, a hang, a crash) before its fix.
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { afterEach, describe, expect, it } from 'vitest';
import { Unpackr, Packr } from 'msgpackr';
import { DescList, NixlAgent, NixlError, allocate } from '../../lib';
import { decodeAgentMetadata, encodeAgentMetadata } from '../../lib/handshake';
import { packMsgpack } from '../../lib/handshake/msgpack';
import { binding } from '../../lib/native';
import { Peer } from '../helpers';

setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc') as () => void;

const open: NixlAgent[] = [];
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

function pair(opts: { testDelayUs?: number } = {}) {
  const a = new NixlAgent(`dp-a-${open.length}`, { engine: 'loopback', ...opts });
  const b = new NixlAgent(`dp-b-${open.length}`, { engine: 'loopback' });
  open.push(a, b);
  a.addRemoteAgent(b.getAgentMetadata());
  return { a, b };
}

function code(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(NixlError);
    return (e as NixlError).code;
  }
  throw new Error('did not throw');
}

describe('completions belong to their posting', () => {
  it('a re-posted prepped transfer resolves only when that posting is done (200 postings)', async () => {
    const { a, b } = pair();
    const BLOCK = 256 << 10;
    const N = 32;
    const src = allocate(BLOCK * N);
    const dst = Buffer.alloc(BLOCK * N);
    b.registerMemory(src);
    a.registerMemory(dst);
    a.addRemoteAgent(b.getPartialAgentMetadata(src, { includeConnInfo: false }));
    const blocks = (m: Buffer | bigint) =>
      DescList.from(
        Array.from({ length: N }, (_, i) =>
          typeof m === 'bigint' ? { addr: m + BigInt(i * BLOCK), len: BLOCK } : m.subarray(i * BLOCK, (i + 1) * BLOCK),
        ),
      );
    const l = a.prepXferDlist('', blocks(dst));
    const r = a.prepXferDlist(b.name, blocks(binding.addressOf(src)));
    const idx = Uint32Array.from({ length: N }, (_, i) => i);
    const h = a.makePreppedXfer('READ', l, idx, r, idx);
    let stale = 0;
    for (let i = 0; i < 200; i++) {
      const mark = i & 0xff;
      src.fill(mark);
      a.transfer(h);
      // Every other posting: wait only once the copy is done, so wait() takes
      // its fast path while the completion event is still queued.
      if (i % 2 === 1)
        while (a.checkXferState(h) === 'PROC') {
          /* spin */
        }
      await a.wait(h);
      expect(a.checkXferState(h)).toBe('DONE');
      for (let k = 0; k < N; k++) if (dst[k * BLOCK] !== mark || dst[(k + 1) * BLOCK - 1] !== mark) stale++;
    }
    expect(stale).toBe(0);
    a.releaseXferHandle(h);
  });
});

describe('closed agents', () => {
  it('waitForNotif on a closed agent rejects at once with NIXL_ERR_NOT_ALLOWED', async () => {
    const { a } = pair();
    a.close();
    await expect(a.waitForNotif({ agent: 'x' }, { timeoutMs: 5000 })).rejects.toMatchObject({
      code: 'NIXL_ERR_NOT_ALLOWED',
    });
    await expect(a.wait({ id: 1, remoteAgent: 'x' } as never)).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_ALLOWED' });
  });
});

describe('descriptor overflow', () => {
  it('a descriptor whose addr + len wraps past 2^64 is NIXL_ERR_INVALID_PARAM everywhere', () => {
    const { a, b } = pair();
    const local = Buffer.alloc(4096, 1);
    const remote = allocate(4096);
    remote.fill(2);
    a.registerMemory(local);
    b.registerMemory(remote);
    a.removeRemoteAgent(b.name);
    a.addRemoteAgent(b.getAgentMetadata());
    const wrap = (addr: bigint) => ({ addr: addr + 16n, len: (1n << 64n) - 8n });
    const la = binding.addressOf(local);
    const ra = binding.addressOf(remote);
    for (const f of [
      () => a.prepXferDlist('', [wrap(la)]),
      () => a.prepXferDlist(b.name, [wrap(ra)]),
      () => a.initializeXfer('READ', [wrap(la)], [wrap(ra)], b.name),
      () => a.initializeXfer('WRITE', local.subarray(0, 16), [wrap(ra)], b.name),
      () => a.getPartialAgentMetadata([wrap(la)]),
      () => a.checkRemoteMetadata(b.name, [wrap(ra)]),
      () => a.queryMemory([wrap(la)]),
      () => a.registerMemory([wrap(la)]),
    ])
      expect(code(f)).toBe('NIXL_ERR_INVALID_PARAM');
    // Just below the wrap: in range arithmetic, still not registered memory.
    expect(code(() => a.prepXferDlist(b.name, [{ addr: ra + 16n, len: (1n << 64n) - ra - 17n }]))).toBe(
      'NIXL_ERR_NOT_FOUND',
    );
    expect(local.every((v) => v === 1)).toBe(true);
  });
});

describe('memory lifetime', () => {
  it('closing a same-process peer while another agent copies from its memory waits for the copy', async () => {
    for (let round = 0; round < 4; round++) {
      const a = new NixlAgent(`life-a-${round}`, { engine: 'loopback' });
      let b: NixlAgent | undefined = new NixlAgent(`life-b-${round}`, { engine: 'loopback' });
      open.push(a);
      const SIZE = 64 << 20;
      const dst = Buffer.alloc(SIZE);
      a.registerMemory(dst);
      let src: Buffer | undefined = allocate(SIZE);
      src.fill(7);
      b.registerMemory(src);
      const addr = binding.addressOf(src);
      a.addRemoteAgent(b.getAgentMetadata());
      const p = a.read(dst, [{ addr, len: SIZE }], b.name).then(
        () => 'ok',
        (e: NixlError) => e.code,
      );
      await new Promise((r) => setTimeout(r, 2 + round * 4));
      b.close();
      b = undefined;
      src = undefined;
      gc();
      const outcome = await p;
      expect(['ok', 'NIXL_ERR_REMOTE_DISCONNECT']).toContain(outcome);
      if (outcome === 'ok') expect(dst[0] === 7 && dst[SIZE - 1] === 7).toBe(true);
    }
  });

  it('registered memory cannot be detached: a transfer of its ArrayBuffer leaves it in place', async () => {
    const { a, b } = pair();
    const src = allocate(1 << 20);
    src.fill(9);
    b.registerMemory(src);
    a.removeRemoteAgent(b.name);
    a.addRemoteAgent(b.getAgentMetadata());
    const dst = new Uint8Array(new ArrayBuffer(1 << 20));
    a.registerMemory(dst);
    structuredClone(dst.buffer, { transfer: [dst.buffer] });
    const { port1, port2 } = new MessageChannel();
    port1.postMessage(dst.buffer, [dst.buffer]);
    port1.close();
    port2.close();
    gc();
    expect(dst.byteLength).toBe(1 << 20);
    await a.read(dst, [{ addr: binding.addressOf(src), len: 1 << 20 }], b.name);
    expect(dst.every((v) => v === 9)).toBe(true);
  });
});

describe('allocate', () => {
  it('sizes past what a Buffer can hold are NIXL_ERR_INVALID_PARAM, not an abort', () => {
    expect(code(() => allocate(2 ** 32 + 1))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => allocate(2 ** 40))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(allocate(4096).length).toBe(4096);
  });
});

describe('metadata that comes off a wire', () => {
  it('a loopback agent name that is not valid UTF-8 is refused', () => {
    const { a } = pair();
    const c = new NixlAgent('utf8-ok-é', { engine: 'loopback' });
    open.push(c);
    const md = Buffer.from(c.getAgentMetadata());
    expect(a.addRemoteAgent(md)).toBe('utf8-ok-é');
    a.removeRemoteAgent('utf8-ok-é');
    // magic (8) + version (4) + flags (1) + length (4), then the name
    const name = md.subarray(17, 17 + Buffer.byteLength('utf8-ok-é'));
    expect(name.toString()).toBe('utf8-ok-é');
    name[name.length - 1] = 0xff;
    expect(code(() => a.addRemoteAgent(md))).toBe('NIXL_ERR_INVALID_PARAM');
  });

  const base = {
    engineId: 'e',
    agentMetadata: Buffer.from('md'),
    kvCachesBaseAddr: [0x7f0000000000n],
    deviceId: 0,
    numBlocks: 4,
    blockLens: [4096],
    kvCacheLayout: 'HND' as const,
    blockSize: 16,
  };
  const withAddr = (addr: unknown, packr = new Packr({ useRecords: false })) =>
    packr.pack({
      engine_id: 'e',
      agent_metadata: Buffer.from('md'),
      kv_caches_base_addr: [addr],
      device_id: 0,
      num_blocks: 4,
      block_lens: [4096],
      kv_cache_layout: 'HND',
      block_size: 16,
    });

  it('kv_caches_base_addr values of 2^64 and above are refused when decoding', () => {
    expect(decodeAgentMetadata(encodeAgentMetadata(base, 'v0.13'), 'v0.13').kvCachesBaseAddr).toEqual([
      0x7f0000000000n,
    ]);
    expect(
      decodeAgentMetadata(encodeAgentMetadata({ ...base, kvCachesBaseAddr: [(1n << 64n) - 1n] }, 'v0.13'), 'v0.13')
        .kvCachesBaseAddr,
    ).toEqual([(1n << 64n) - 1n]);
    const f64 = (v: number) =>
      Buffer.concat([
        Buffer.from([0xcb]),
        (() => {
          const b = Buffer.alloc(8);
          b.writeDoubleBE(v);
          return b;
        })(),
      ]);
    const withRaw = (raw: Buffer) => {
      const m = encodeAgentMetadata(base, 'v0.13');
      const at = m.indexOf(packMsgpack(0x7f0000000000n));
      return Buffer.concat([m.subarray(0, at), raw, m.subarray(at + 9)]);
    };
    for (const bad of [
      withRaw(f64(1e20)),
      withRaw(f64(2 ** 64)),
      withRaw(f64(2 ** 60)),
      withAddr(1n << 64n, new Packr({ useRecords: false, useBigIntExtension: true })),
    ]) {
      expect(() => decodeAgentMetadata(bad, 'v0.13')).toThrow(
        expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
      );
    }
    // Sanity: the extension really decodes to a bigint >= 2^64 in msgpackr.
    expect(
      new Unpackr({ useRecords: false }).unpack(
        withAddr(1n << 64n, new Packr({ useRecords: false, useBigIntExtension: true })),
      ),
    ).toMatchObject({ kv_caches_base_addr: [1n << 64n] });
  });

  it('encodeAgentMetadata refuses addresses outside uint64', () => {
    for (const bad of [-1n, 1n << 64n, -1, 1.5, 2 ** 64]) {
      expect(() => encodeAgentMetadata({ ...base, kvCachesBaseAddr: [bad as bigint] }, 'v0.13')).toThrow(
        expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
      );
    }
  });
});

describe('overlapping source and destination in one process (issue 26)', () => {
  // The same memory registered by both agents: a READ or WRITE whose two
  // ranges overlap is copied as memmove would (each descriptor in list order),
  // never as an overlapping memcpy (ASan: memcpy-param-overlap).
  for (const [op, shift] of [
    ['READ', 4096],
    ['READ', -4096],
    ['WRITE', 100_000],
    ['WRITE', -3],
  ] as const) {
    it(`${op}, destination ${shift > 0 ? 'after' : 'before'} the source by ${Math.abs(shift)} bytes`, async () => {
      const { a, b } = pair();
      const mem = allocate(1 << 20);
      for (let i = 0; i < mem.length; i++) mem[i] = (i * 31 + (i >> 9)) & 0xff;
      a.registerMemory(mem);
      b.registerMemory(mem);
      a.removeRemoteAgent(b.name); // loaded before b registered anything
      a.addRemoteAgent(b.getAgentMetadata());
      const len = 512 << 10;
      const base = DescList.from(mem).addr(0);
      const from = 200_000;
      const to = from + shift;
      const want = Buffer.from(mem);
      want.copyWithin(to, from, from + len);
      // READ copies remote -> local, WRITE local -> remote: pick which side is the source.
      const local = { addr: base + BigInt(op === 'READ' ? to : from), len };
      const remote = { addr: base + BigInt(op === 'READ' ? from : to), len };
      if (op === 'READ') await a.read([local], [remote], b.name);
      else await a.write([local], [remote], b.name);
      expect(mem.equals(want)).toBe(true);
    });
  }
});

describe('region sizes a peer in another process claims (issue 26)', () => {
  // A peer registers 32 KiB of a 128 KiB shared allocation; its metadata,
  // tampered on the way, claims all 128 KiB. Before, a READ landed 96 KiB past
  // the real registration (inside the peer's mapping) and succeeded.
  for (const shared of [true, false]) {
    it(`metadata claiming 4x the registered range is refused at load, nothing read (${shared ? 'shared mapping' : 'process_vm'})`, async () => {
      const peer = new Peer('peer.js');
      try {
        const REG = 32 << 10;
        const { md, addr } = await peer.request<{ md: Uint8Array; addr: bigint }>({
          cmd: 'init',
          name: `claim-peer-${shared}`,
          size: 4 * REG,
          shared,
          seed: 3,
          regLen: REG,
        });
        const blob = Buffer.from(md);
        const a = new NixlAgent(`claim-a-${shared}`, { engine: 'loopback' });
        open.push(a);
        const dst = Buffer.alloc(4 * REG);
        a.registerMemory(dst);
        // The honest metadata loads and bounds reads to what was registered.
        a.addRemoteAgent(blob);
        await expect(
          a.read(dst.subarray(0, 2 * REG), [{ addr: BigInt(addr), len: 2 * REG }], `claim-peer-${shared}`),
        ).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_FOUND' });
        a.removeRemoteAgent(`claim-peer-${shared}`);
        // [addr u64][len u64] of the one region, little-endian: claim 4x.
        const at = findRegion(blob, BigInt(addr), BigInt(REG));
        const forged = Buffer.from(blob);
        forged.writeBigUInt64LE(BigInt(4 * REG), at + 8);
        let err: unknown;
        try {
          a.addRemoteAgent(forged);
        } catch (e) {
          err = e;
        }
        expect(err).toBeInstanceOf(NixlError);
        expect(err).toMatchObject({ code: 'NIXL_ERR_MISMATCH' });
        expect(String((err as Error).message)).toMatch(/claims .* but it registered/);
        // Nothing of it was loaded: a READ past the registration has no agent to go to.
        expect(
          code(() => a.prepXferDlist(`claim-peer-${shared}`, [{ addr: BigInt(addr) + BigInt(2 * REG), len: REG }])),
        ).toBe('NIXL_ERR_NOT_FOUND');
        expect(dst.every((x) => x === 0)).toBe(true);
      } finally {
        peer.kill();
      }
    });
  }
});

function findRegion(blob: Buffer, addr: bigint, len: bigint): number {
  for (let i = 0; i + 16 <= blob.length; i++)
    if (blob.readBigUInt64LE(i) === addr && blob.readBigUInt64LE(i + 8) === len) return i;
  throw new Error('region not found in the metadata');
}
