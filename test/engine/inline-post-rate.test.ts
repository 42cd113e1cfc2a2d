// The first post of a request larger than inlinePostMaxBytes, never timed,
// predicted from the last timed post to the same remote agent: pullers and
// push senders make a new request per transfer, and each first post would
// otherwise take the hop to the engine's thread and back. The prediction
// scales the last sample by bytes and by descriptors (the larger ratio); it
// goes inline only when that is at most inlinePostMaxUs. Asserted by the path
// taken (DONE from transfer(): finished inside the post, which UCX's cma and
// the loopback engine do for a one-host READ or WRITE; PROC: the engine's
// thread), with limits generous enough, or ratios large enough, that no
// measured time decides it. NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { expect, it } from 'vitest';
import { type AgentOptions, NixlAgent, allocate } from '../../lib';
import { Peer, checkPattern, eachEngine, engineAgent, pattern } from '../helpers';

const SMALL = 64 << 10; // inlinePostMaxBytes in these tests
const SIZE = 1 << 20; // the requests: over it
const GENEROUS_US = 10_000_000; // no copy of SIZE takes 10 s
/** A fresh turn of the event loop: its inline budget is whole again. */
const freshTurn = () => new Promise<void>((r) => setImmediate(r));

eachEngine('first posts predicted from the remote agent (inlinePostMaxUs): %s engine', (engine, open) => {
  const agent = (name: string, extra: AgentOptions = {}): NixlAgent =>
    engineAgent(engine, open, `${name}-${engine}`, extra);

  /** a, and peers holding `size` bytes of pattern 5 each, loaded both ways. */
  function setup(extra: AgentOptions, peers = ['b'], size = SIZE) {
    const a = agent('rate-a', { inlinePostMaxBytes: SMALL, ...extra });
    const local = allocate(size);
    a.registerMemory(local);
    const remote: Record<string, { name: string; mem: Buffer; agent: NixlAgent }> = {};
    for (const p of peers) {
      const b = agent(`rate-${p}`);
      const mem = allocate(size);
      pattern(mem, 5);
      b.registerMemory(mem);
      a.addRemoteAgent(b.getAgentMetadata());
      b.addRemoteAgent(a.getAgentMetadata());
      remote[p] = { name: b.name, mem, agent: b };
    }
    return { a, local, remote };
  }

  /** As KvPuller does: a new handle, one post in a fresh turn, wait, release. transfer()'s state. */
  async function pullOnce(a: NixlAgent, local: Buffer, mem: Buffer, peer: string, op: 'READ' | 'WRITE' = 'READ') {
    const h = a.initializeXfer(op, local, mem, peer);
    await freshTurn();
    const state = a.transfer(h);
    await a.wait(h, { timeoutMs: 10_000 });
    a.releaseXferHandle(h);
    return state;
  }

  it("a new READ handle's first post goes inline once a post to the same agent was timed under the limit; a WRITE's is never predicted", async () => {
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US });
    const b = remote.b;
    // No post to b was timed yet: the engine's thread.
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    for (let i = 0; i < 3; i++) {
      local.fill(0);
      expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
      expect(checkPattern(local, 5)).toBe(true);
    }
    // A WRITE fills the peer's pages, which may never have been touched: its
    // first post goes through the engine's thread however quick the sample.
    pattern(local, 9);
    expect(await pullOnce(a, local, b.mem, b.name, 'WRITE')).toBe('PROC');
    expect(checkPattern(b.mem, 9)).toBe(true);
    b.mem.fill(0);
    expect(await pullOnce(a, local.subarray(0, SIZE / 2), b.mem.subarray(0, SIZE / 2), b.name, 'WRITE')).toBe('PROC');
    expect(checkPattern(b.mem.subarray(0, SIZE / 2), 9)).toBe(true);
    // The WRITEs were timed, and the last one (half the size) is the agent's
    // sample: a READ of that size still goes inline.
    local.fill(0);
    expect(await pullOnce(a, local.subarray(0, SIZE / 2), b.mem.subarray(0, SIZE / 2), b.name)).toBe('DONE');
    expect(checkPattern(local.subarray(0, SIZE / 2), 9)).toBe(true); // what the WRITEs left there
  });

  it('a READ into local pages never touched is not predicted (no sample measured their faults), then is once they were', async () => {
    // Pages never touched fault in during the copy: about 2.5 us per 4 KiB
    // page here, 1.3 ms per 2 MiB, where the warm copy takes 60-140 us.
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US });
    const b = remote.b;
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
    // The same size into memory registered and never written: allocate()'s
    // (a memfd) and a plain Buffer's (anonymous memory, zero until written).
    // A Buffer that small may come from malloc's heap, already touched: one
    // over glibc's largest mmap threshold (32 MiB) is a fresh mapping. Not
    // with NIXL loaded: UCX's malloc replacement hands out calloc memory
    // already touched (resident, so rightly predicted).
    const buffers = engine === 'loopback' ? [Buffer.alloc(40 << 20).subarray(0, SIZE)] : [];
    for (const fresh of [allocate(SIZE), ...buffers]) {
      a.registerMemory(fresh);
      expect(await pullOnce(a, fresh, b.mem, b.name)).toBe('PROC');
      expect(checkPattern(fresh, 5)).toBe(true);
      // That copy touched every page: now inline.
      fresh.fill(0);
      expect(await pullOnce(a, fresh, b.mem, b.name)).toBe('DONE');
      expect(checkPattern(fresh, 5)).toBe(true);
    }
  });

  it('a READ of more than 16 separate ranges of local memory is not predicted (the check would cost more than the hop)', async () => {
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US });
    const b = remote.b;
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
    // Every other block: n separate ranges of warm memory.
    const blocks = (m: Buffer, n: number, size: number) =>
      Array.from({ length: n }, (_, i) => m.subarray(2 * i * size, (2 * i + 1) * size));
    const pull = async (n: number, size: number) => {
      local.fill(0);
      const h = a.initializeXfer('READ', blocks(local, n, size), blocks(b.mem, n, size), b.name);
      await freshTurn();
      const state = a.transfer(h);
      await a.wait(h, { timeoutMs: 10_000 });
      a.releaseXferHandle(h);
      for (const [i, blk] of blocks(local, n, size).entries()) expect(checkPattern(blk, 5, 2 * i * size)).toBe(true);
      return state;
    };
    // 8 ranges of 16 KiB: checked, warm, predicted inline; its time is the sample now.
    expect(await pull(8, 16 << 10)).toBe('DONE');
    // The same 128 KiB in 32 ranges of 4 KiB (4 times the sample's descriptors,
    // inline by the generous limit): not checked, so not predicted.
    expect(await pull(32, 4 << 10)).toBe('PROC');
  });

  it('with no sample for the agent, or inlinePostMaxUs: 0, a new handle goes through the engine thread', async () => {
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US }, ['b', 'c']);
    expect(await pullOnce(a, local, remote.b.mem, remote.b.name)).toBe('PROC');
    expect(await pullOnce(a, local, remote.b.mem, remote.b.name)).toBe('DONE');
    // b's sample says nothing of c.
    local.fill(0);
    expect(await pullOnce(a, local, remote.c.mem, remote.c.name)).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    expect(await pullOnce(a, local, remote.c.mem, remote.c.name)).toBe('DONE');
    for (const x of open.splice(0)) x.close();

    const off = setup({ inlinePostMaxUs: 0 });
    for (let i = 0; i < 3; i++) {
      off.local.fill(0);
      expect(await pullOnce(off.a, off.local, off.remote.b.mem, off.remote.b.name)).toBe('PROC');
      expect(checkPattern(off.local, 5)).toBe(true);
    }
  });

  it('a request predicted over the limit (1024 times the bytes or the descriptors of the sample) goes through the engine thread', async () => {
    // The sample: a 64 KiB post, over inlinePostMaxBytes 16 KiB. Scaled 1024
    // times, even a sample of 1 us (the least one counts) predicts more than
    // the 1000 us limit, whatever this machine's speed.
    const SAMPLE = 64 << 10;
    const HUGE = SAMPLE * 1024;
    const { a, local, remote } = setup({ inlinePostMaxBytes: 16 << 10, inlinePostMaxUs: 1000 }, ['b'], HUGE);
    const b = remote.b;
    const sample = () => pullOnce(a, local.subarray(0, SAMPLE), b.mem.subarray(0, SAMPLE), b.name);
    /** Samples until one is posted inline: true once one was (a 64 KiB copy in 1 ms, all but always the first). */
    const untilInline = async () => {
      for (let i = 0; i < 20; i++) if ((await sample()) === 'DONE') return true;
      return false;
    };
    expect(await sample()).toBe('PROC');
    expect(await untilInline()).toBe(true);
    // 64 MiB: the engine's thread, its bytes all there.
    local.fill(0);
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    // The 64 MiB copy replaced the sample; small ones take it back.
    expect(await untilInline()).toBe(true);
    // 64 KiB in 1024 descriptors of 64 bytes: the engine's thread.
    const step = SAMPLE / 1024;
    const parts = (m: Buffer) => Array.from({ length: 1024 }, (_, i) => m.subarray(i * step, (i + 1) * step));
    local.fill(0, 0, SAMPLE);
    const many = a.initializeXfer('READ', parts(local), parts(b.mem), b.name);
    await freshTurn();
    expect(a.transfer(many)).toBe('PROC');
    await a.wait(many, { timeoutMs: 10_000 });
    expect(checkPattern(local.subarray(0, SAMPLE), 5)).toBe(true);
    a.releaseXferHandle(many);
  });

  it("a request with more bytes than its agent's last timed post goes through the engine's thread, then its size is known", async () => {
    // A worker's KV pool hands back its lowest free blocks first: short
    // prompts keep reusing warm pages, and the first long one lands on pages
    // never touched, whose faults no smaller sample measured (a 12 MiB first
    // post predicted at ~450 us from warm 1.25 MiB pulls held the loop 8 ms).
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US });
    const b = remote.b;
    const half = (m: Buffer) => m.subarray(0, SIZE / 2);
    expect(await pullOnce(a, half(local), half(b.mem), b.name)).toBe('PROC');
    expect(await pullOnce(a, half(local), half(b.mem), b.name)).toBe('DONE');
    // Twice the bytes of the sample, into the half never written: the engine's thread.
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    // Now sampled at that size: a new request of it, or smaller, goes inline.
    local.fill(0);
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
    expect(checkPattern(local, 5)).toBe(true);
    expect(await pullOnce(a, half(local), half(b.mem), b.name)).toBe('DONE');
  });

  it('an agent removed and loaded again starts with no sample', async () => {
    const { a, local, remote } = setup({ inlinePostMaxUs: GENEROUS_US });
    const b = remote.b;
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
    a.removeRemoteAgent(b.name);
    a.addRemoteAgent(b.agent.getAgentMetadata());
    local.fill(0);
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    expect(await pullOnce(a, local, b.mem, b.name)).toBe('DONE');
  });
});

it("loopback: a peer process's allocate() memory (mapped here, memcpy) and its plain memory (process_vm_readv) are sampled apart", async () => {
  // Measured: 2 MiB from a peer's allocate() memory in 54-58 us inline, from
  // its plain Buffer in 182-222 us (3-4.6 times): one sample for both sent
  // the slower kind's first posts inline at several times the prediction.
  const peer = new Peer('peer.js');
  const a = new NixlAgent(`rate-paths-${process.pid}`, {
    engine: 'loopback',
    inlinePostMaxBytes: SMALL,
    inlinePostMaxUs: GENEROUS_US,
  });
  try {
    const init = await peer.request<{ md: Uint8Array; addr: bigint; plainAddr: bigint }>({
      cmd: 'init',
      name: `rate-paths-peer-${process.pid}`,
      size: SIZE,
      shared: true,
      seed: 5,
      plain: SIZE,
    });
    const local = allocate(SIZE);
    a.registerMemory(local);
    const name = a.addRemoteAgent(Buffer.from(init.md));
    const pull = async (addr: bigint) => {
      local.fill(0);
      const h = a.initializeXfer('READ', local, [{ addr: BigInt(addr), len: SIZE }], name);
      await freshTurn();
      const state = a.transfer(h);
      await a.wait(h, { timeoutMs: 10_000 });
      a.releaseXferHandle(h);
      expect(checkPattern(local, 5)).toBe(true);
      return state;
    };
    expect(await pull(init.addr)).toBe('PROC');
    expect(await pull(init.addr)).toBe('DONE');
    // The mapped memory's sample says nothing of the plain memory's copies.
    expect(await pull(init.plainAddr)).toBe('PROC');
    expect(await pull(init.plainAddr)).toBe('DONE');
    // Nor the plain memory's of the mapped memory's: each kind keeps its own.
    expect(await pull(init.addr)).toBe('DONE');
  } finally {
    a.close();
    peer.kill();
    await peer.exit();
  }
});
