// Small transfers posted on the calling thread (AgentOptions.inlinePostMaxBytes):
// DONE when transfer() returns, no overtaking of what was posted before them,
// failures reported by the post itself, and never at the event loop's cost.
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, allocate } from '../../lib';
import { DEFAULT_INLINE_POST_MAX_BYTES } from '../../lib/agent';
import { Peer, checkPattern, pattern } from '../helpers';

const open: NixlAgent[] = [];
function agent(name: string, opts = {}): NixlAgent {
  const a = new NixlAgent(name, { engine: 'loopback', ...opts });
  open.push(a);
  return a;
}
let peer: Peer | undefined;
/** A fresh turn of the event loop: its inline budget (1 ms of inline work per turn) is whole again. */
const freshTurn = () => new Promise<void>((r) => setImmediate(r));
afterEach(async () => {
  for (const a of open.splice(0)) a.close();
  if (peer && peer.proc.exitCode === null) peer.kill();
  peer = undefined;
});

/** a pulls from b's `size` bytes of pattern 7. */
function pair(size: number, opts = {}) {
  const a = agent('inl-a', opts);
  const b = agent('inl-b');
  const local = allocate(size);
  const remote = allocate(size);
  pattern(remote, 7);
  a.registerMemory(local);
  b.registerMemory(remote);
  a.addRemoteAgent(b.getAgentMetadata());
  b.addRemoteAgent(a.getAgentMetadata());
  return { a, b, local, remote };
}

/** An agent that loaded 'child', a peer process holding 1 MiB of pattern 2 at init.addr. */
async function withChild() {
  const a = agent('parent');
  const mem = allocate(1 << 20);
  a.registerMemory(mem);
  peer = new Peer('peer.js');
  const init = await peer.request<{ md: Uint8Array; addr: bigint }>({
    cmd: 'init',
    name: 'child',
    size: 1 << 20,
    shared: false,
    seed: 2,
  });
  a.addRemoteAgent(Buffer.from(init.md));
  return { a, mem, init };
}

describe('inline posting (loopback engine)', () => {
  it('a transfer up to inlinePostMaxBytes is DONE when transfer() returns; a larger one is PROC', async () => {
    const size = 2 * DEFAULT_INLINE_POST_MAX_BYTES;
    const { a, local, remote } = pair(size);
    const small = a.initializeXfer('READ', local.subarray(0, 4096), remote.subarray(0, 4096), 'inl-b');
    await freshTurn();
    expect(a.transfer(small)).toBe('DONE');
    expect(a.checkXferState(small)).toBe('DONE');
    expect(checkPattern(local.subarray(0, 4096), 7)).toBe(true);
    await a.wait(small); // settles with no event to wait for
    // a re-post of it finishes inline too, each posting its own
    local.fill(0, 0, 4096);
    await freshTurn();
    expect(a.transfer(small)).toBe('DONE');
    expect(checkPattern(local.subarray(0, 4096), 7)).toBe(true);
    a.releaseXferHandle(small);
    const limit = a.initializeXfer(
      'READ',
      local.subarray(0, DEFAULT_INLINE_POST_MAX_BYTES),
      remote.subarray(0, DEFAULT_INLINE_POST_MAX_BYTES),
      'inl-b',
    );
    await freshTurn();
    expect(a.transfer(limit)).toBe('DONE');
    a.releaseXferHandle(limit);
    local.fill(0);
    const large = a.initializeXfer('READ', local, remote, 'inl-b');
    expect(a.transfer(large)).toBe('PROC');
    await a.wait(large, { timeoutMs: 10_000 });
    expect(checkPattern(local, 7)).toBe(true);
    a.releaseXferHandle(large);
  });

  it('past 1 ms of inline work in one turn of the loop (and at most 128 KiB more): one more post runs inline but reads PROC, its wait settles at the next turn', async () => {
    const { a, local, remote } = pair(4096);
    const h = a.initializeXfer('READ', local, remote, 'inl-b');
    await freshTurn();
    expect(a.transfer(h)).toBe('DONE');
    const until = performance.now() + 2;
    while (performance.now() < until) {} // this turn's budget spent
    // A transfer of known size reads the clock once per 128 KiB of posts: up
    // to 32 more 4 KiB posts may go inline, the one after them reads it.
    let inlineAfter = 0;
    let state: string;
    for (;;) {
      local.fill(0);
      state = a.transfer(h);
      if (state !== 'DONE' || ++inlineAfter > 32) break;
    }
    expect(inlineAfter).toBeLessThanOrEqual(32);
    // The late post: copied inline (the bytes are there), reported unfinished
    // so that a loop of transfer(); await wait() lets the event loop turn.
    expect(state).toBe('PROC');
    expect(checkPattern(local, 7)).toBe(true);
    expect(a.checkXferState(h)).toBe('DONE');
    let settled = false;
    const waited = a.wait(h).then(() => {
      settled = true;
    });
    for (let i = 0; i < 10; i++) await Promise.resolve();
    expect(settled).toBe(false); // not as a microtask of this turn
    await waited;
    await freshTurn();
    expect(a.transfer(h)).toBe('DONE');
    a.releaseXferHandle(h);
  });

  it('past the budget, the one late post fails inline (ERR at once); the next post of that turn goes through the engine thread', async () => {
    const { a, mem, init } = await withChild();
    // Over 128 KiB each: every post of them reads the budget's clock.
    const SZ = 160 << 10;
    const hs = [0, 1, 2].map((i) =>
      a.initializeXfer(
        'READ',
        mem.subarray(i * SZ, (i + 1) * SZ),
        DescList.from([{ addr: init.addr + BigInt(i * SZ), len: SZ }]),
        'child',
      ),
    );
    peer.kill();
    await peer.exit();
    // An inline post to a peer that is gone fails in the post itself; one
    // through the engine thread is PROC, and its wait rejects.
    await freshTurn();
    expect(a.transfer(hs[0])).toBe('ERR');
    const until = performance.now() + 2;
    while (performance.now() < until) {} // this turn's budget spent
    expect(a.transfer(hs[1])).toBe('ERR'); // the late post: inline all the same
    expect(a.transfer(hs[2])).toBe('PROC'); // the rest of the turn: the engine thread
    await expect(a.wait(hs[2], { timeoutMs: 10_000 })).rejects.toMatchObject({ code: 'NIXL_ERR_REMOTE_DISCONNECT' });
    // A fresh turn: inline again.
    await freshTurn();
    expect(a.transfer(hs[2])).toBe('ERR');
    for (const h of hs) a.releaseXferHandle(h);
  });

  it('layers of a layered request read the clock once per 128 KiB: past 1 ms in one turn, at most that much more goes inline', async () => {
    const LAYERS = 64;
    const BLOCK = 4096;
    const { a, local, remote } = pair(LAYERS * BLOCK);
    const blocks = (mem: Buffer) =>
      DescList.from(Array.from({ length: LAYERS }, (_, i) => mem.subarray(i * BLOCK, (i + 1) * BLOCK)));
    const ll = a.prepXferDlist('NIXL_INIT_AGENT', blocks(local));
    const rl = a.prepXferDlist('inl-b', blocks(remote));
    const layers = Array.from({ length: LAYERS }, (_, l) => [l]);
    const h = a.makeLayeredXfer('READ', ll, layers, rl, layers);
    await freshTurn();
    expect(a.postLayer(h, 0)).toBe('PROC');
    const until = performance.now() + 2;
    while (performance.now() < until) {} // this turn's budget spent
    // 128 KiB of layers may still go inline; the layer after them reads the
    // clock and goes through the engine thread, and every later one queues
    // behind it: the last is not DONE when postLayer returns.
    for (let l = 1; l < LAYERS - 1; l++) a.postLayer(h, l);
    expect(a.postLayer(h, LAYERS - 1)).toBe('PROC');
    await a.wait(h, { timeoutMs: 10_000 });
    expect(checkPattern(local, 7)).toBe(true);
    // The next posting, in a fresh turn: every byte again.
    local.fill(0);
    await freshTurn();
    for (let l = 0; l < LAYERS; l++) a.postLayer(h, l);
    await a.wait(h, { timeoutMs: 10_000 });
    expect(checkPattern(local, 7)).toBe(true);
    a.releaseXferHandle(h);
  });

  it('inlinePostMaxBytes: 0 posts every transfer through the engine thread', async () => {
    const { a, local, remote } = pair(4096, { inlinePostMaxBytes: 0 });
    const h = a.initializeXfer('READ', local, remote, 'inl-b');
    expect(a.transfer(h)).toBe('PROC');
    await a.wait(h, { timeoutMs: 10_000 });
    expect(checkPattern(local, 7)).toBe(true);
    a.releaseXferHandle(h);
  });

  it('a small transfer posted behind a queued large one waits its turn: notifications keep their order', async () => {
    const big = 64 << 20;
    const { a, b, local, remote } = pair(big + 4096);
    const large = a.initializeXfer('READ', local.subarray(0, big), remote.subarray(0, big), 'inl-b', 'first');
    const small = a.initializeXfer(
      'READ',
      local.subarray(big, big + 4096),
      remote.subarray(big, big + 4096),
      'inl-b',
      'second',
    );
    let queued = 0;
    for (let round = 0; round < 5; round++) {
      expect(a.transfer(large)).toBe('PROC');
      // The worker still has the large one: the small one queues behind it.
      // Only a finished large one lets it go inline (this thread descheduled
      // for the large copy's few ms on a loaded machine).
      if (a.transfer(small) === 'PROC') queued++;
      else expect(a.checkXferState(large)).toBe('DONE');
      await Promise.all([a.wait(large, { timeoutMs: 10_000 }), a.wait(small, { timeoutMs: 10_000 })]);
      const got: string[] = [];
      while (got.length < 2) {
        const n = await b.waitForNotif({ agent: 'inl-a' }, { timeoutMs: 10_000 });
        got.push(n.msg.toString());
      }
      expect(got).toEqual(['first', 'second']);
    }
    expect(queued).toBeGreaterThan(0);
    // Idle again: the small one goes inline.
    await freshTurn();
    expect(a.transfer(small)).toBe('DONE');
    expect((await b.waitForNotif({ agent: 'inl-a' }, { timeoutMs: 10_000 })).msg.toString()).toBe('second');
  });

  it('an inline transfer that fails is ERR from transfer(), and wait rejects with its error', async () => {
    const { a, mem, init } = await withChild();
    const h = a.initializeXfer('READ', mem.subarray(0, 4096), DescList.from([{ addr: init.addr, len: 4096 }]), 'child');
    await freshTurn();
    expect(a.transfer(h)).toBe('DONE');
    expect(checkPattern(mem.subarray(0, 4096), 2)).toBe(true);
    peer.kill();
    await peer.exit();
    await freshTurn();
    expect(a.transfer(h)).toBe('ERR');
    expect(a.getXferError(h)?.code).toBe('NIXL_ERR_REMOTE_DISCONNECT');
    await expect(a.wait(h)).rejects.toMatchObject({ code: 'NIXL_ERR_REMOTE_DISCONNECT' });
    a.releaseXferHandle(h);
  });

  it('telemetry of an inline transfer: its post took the whole transfer', async () => {
    const { a, local, remote } = pair(4096, { captureTelemetry: true });
    const h = a.initializeXfer('WRITE', local, remote, 'inl-b');
    await freshTurn();
    expect(a.transfer(h)).toBe('DONE');
    const t = a.getXferTelemetry(h);
    expect(t.totalBytes).toBe(4096);
    expect(t.descCount).toBe(1);
    expect(t.postDurationUs).toBe(t.xferDurationUs);
    a.releaseXferHandle(h);
  });
});
