// Inline posts by time (inlinePostMaxUs) and the late post (the first post
// past a turn's inline budget, posted inline, reported PROC, its wait settled
// at the next turn) under attack: every byte checked after every posting,
// waits that must settle once and not too early, reposts, releases and
// notifications right after such posts, and the event loop kept turning.
// NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { afterEach, describe, expect, it } from 'vitest';
import { type AgentOptions, DescList, NixlAgent, type NixlError, allocate } from '../../lib';
import { inlineBudgetLeft } from '../../lib/agent/inline-budget';
import { Peer, checkPattern, eachEngine, engineAgent, preparedBlocks, settledWithin } from '../helpers';

const SMALL = 64 << 10; // inlinePostMaxBytes in these tests
const MIB = 1 << 20;
/** A fresh turn of the event loop: its inline budget is whole again. */
const freshTurn = () => new Promise<void>((r) => setImmediate(r));
/** Spends this turn's inline budget (1 ms from its first inline work): the engines' threads keep running. */
const spendBudget = (): void => {
  inlineBudgetLeft(); // the turn's inline work starts here, if it had not yet
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 3);
  // Seen spent now: a post of known size reads the clock only once per 128 KiB.
  inlineBudgetLeft();
};
/** 'wait' when p settles before `ticks` microtasks ran, else 'ticks'. */
async function beforeTicks(p: Promise<unknown>, ticks: number): Promise<'wait' | 'ticks'> {
  let first: 'wait' | 'ticks' | undefined;
  void p.then(
    () => {
      first ??= 'wait';
    },
    () => {
      first ??= 'wait';
    },
  );
  for (let i = 0; i < ticks && !first; i++) await Promise.resolve();
  first ??= 'ticks';
  await p.catch(() => {});
  return first;
}

eachEngine('inline posts by time and late posts under attack: %s engine', (engine, open) => {
  const agent = (name: string, extra: AgentOptions = {}): NixlAgent =>
    engineAgent(engine, open, `${name}-${engine}`, extra);

  /** a reads from / writes to b's `size` bytes; both load each other. */
  function pair(size: number, extra: AgentOptions = {}) {
    const a = agent('atk-a', { inlinePostMaxBytes: SMALL, ...extra });
    const b = agent('atk-b');
    const local = allocate(size);
    const remote = allocate(size);
    const la = a.registerMemory(local);
    const rb = b.registerMemory(remote);
    a.addRemoteAgent(b.getAgentMetadata());
    b.addRemoteAgent(a.getAgentMetadata());
    return { a, b, local, remote, la, rb };
  }

  /** Posts h until a post of it finishes inline (its time is learned on the first): true once one did. */
  async function warm(a: NixlAgent, h: ReturnType<NixlAgent['initializeXfer']>): Promise<boolean> {
    for (let i = 0; i < 20; i++) {
      await freshTurn();
      const s = a.transfer(h);
      await a.wait(h, { timeoutMs: 10_000 });
      if (s === 'DONE') return true;
    }
    return false;
  }

  it('a late post of a layered request that finishes the posting settles the waits already pending on it', async () => {
    const a = agent('atk-la');
    const b = agent('atk-lb');
    const BLOCK = 4096;
    const { ma, mb, local, remote } = preparedBlocks(a, b, 3, BLOCK);
    const h = a.makeLayeredXfer('READ', local, [[0], [1], [2]], remote, [[0], [1], [2]]);
    const outcomes: string[] = [];
    for (let k = 1; k <= 3; k++) {
      await freshTurn();
      mb.fill(k);
      ma.fill(0);
      a.postLayer(h, 0);
      const w = a.wait(h);
      spendBudget(); // past the turn's budget: the next post is the late one
      const s = a.transfer(h);
      outcomes.push(`${s} ${await settledWithin(w, 3000)}`);
      expect(ma.every((x) => x === k)).toBe(true);
    }
    expect(outcomes.filter((o) => !o.endsWith('resolved'))).toEqual([]);
  });

  it("a layered request's transfer() past the turn's budget posts its layers through the engine thread, not all of them inline", async () => {
    // The late post is one post: a layered request's transfer() posts every
    // layer, here 32 MiB, which would hold the event loop for all their copies.
    const a = agent('atk-lga');
    const b = agent('atk-lgb');
    const L = 32;
    const { ma, mb, local, remote } = preparedBlocks(a, b, L, MIB);
    const idx = Array.from({ length: L }, (_, i) => [i]);
    const h = a.makeLayeredXfer('READ', local, idx, remote, idx);
    const after: string[] = [];
    for (let k = 1; k <= 3; k++) {
      await freshTurn();
      mb.fill(k);
      spendBudget();
      expect(a.transfer(h)).toBe('PROC');
      // Through the engine's thread the 32 MiB are still moving now (unless
      // this thread was descheduled meanwhile, hence three tries).
      after.push(a.checkXferState(h));
      await a.wait(h, { timeoutMs: 10_000 });
      expect(ma.equals(mb)).toBe(true);
    }
    expect(after).toContain('PROC');
  });

  it("a layered request's transfer() in a fresh turn copies at most inlinePostMaxBytes of its layers inline, the rest through the engine thread", async () => {
    // One call posts every layer: all inline, they would hold the event loop
    // for every copy (16 x 1 MiB: 2.3-13.7 ms measured on NIXL), where one
    // request of that size goes through the engine's thread.
    const a = agent('atk-lfa', { inlinePostMaxBytes: MIB });
    const b = agent('atk-lfb');
    const L = 16;
    const LAYER = 256 << 10;
    const { ma, mb, local, remote } = preparedBlocks(a, b, L, LAYER);
    const idx = Array.from({ length: L }, (_, i) => [i]);
    const h = a.makeLayeredXfer('READ', local, idx, remote, idx);
    for (let k = 1; k <= 3; k++) {
      mb.fill(k);
      ma.fill(0);
      await freshTurn();
      // Layers complete through events this thread has not run yet: PROC.
      expect(a.transfer(h)).toBe('PROC');
      // The first MiB was copied inline: in place when transfer() returned.
      expect(ma.subarray(0, MIB).every((x) => x === k)).toBe(true);
      await a.wait(h, { timeoutMs: 10_000 });
      expect(ma.equals(mb)).toBe(true);
    }
  });

  it('a late post moves every byte, reads PROC, and its wait settles at the next turn, not as a microtask', async () => {
    const { a, local, remote } = pair(SMALL);
    const h = a.initializeXfer('READ', local, remote, `atk-b-${engine}`);
    const states: string[] = [];
    let lateDone = 0;
    for (let k = 1; k <= 20; k++) {
      await freshTurn();
      remote.fill(k);
      spendBudget();
      const s = a.transfer(h);
      states.push(s);
      if (s === 'PROC' && a.checkXferState(h) === 'DONE') {
        // Finished inline past the budget: bytes in place now, the wait for the next turn.
        lateDone++;
        expect(local.equals(remote)).toBe(true);
        expect(await beforeTicks(a.wait(h), 1000)).toBe('ticks');
      } else {
        await a.wait(h, { timeoutMs: 10_000 });
      }
      expect(local.equals(remote)).toBe(true);
    }
    expect(states).not.toContain('DONE');
    expect(lateDone).toBeGreaterThan(0); // the late path was taken
  });

  it('a repost right after a late post (before its wait settled) goes through the engine thread; each wait settles once, after its own bytes', async () => {
    const { a, local, remote } = pair(SMALL);
    const h = a.initializeXfer('READ', local, remote, `atk-b-${engine}`);
    let reposted = 0;
    for (let k = 1; k <= 30; k++) {
      await freshTurn();
      remote.fill(2 * k);
      spendBudget();
      a.transfer(h); // the late post
      const w1 = a.wait(h);
      let w1Count = 0;
      void w1.then(() => w1Count++);
      if (a.checkXferState(h) !== 'DONE') {
        await w1;
        continue;
      }
      reposted++;
      expect(local.equals(remote)).toBe(true);
      remote.fill(2 * k + 1);
      expect(a.transfer(h)).toBe('PROC'); // the rest of the turn's posts: the engine's thread
      const w2 = a.wait(h, { timeoutMs: 10_000 });
      await w1;
      await w2;
      expect(w1Count).toBe(1);
      expect(local.equals(remote)).toBe(true);
    }
    expect(reposted).toBeGreaterThan(0);
  });

  it('a request reposted thousands of times, its time around inlinePostMaxUs, moves every byte of every posting', async () => {
    const size = 2 * MIB;
    // Its copy time, measured here on the engine thread: set the limit at it
    // so that posts cross it both ways (and a loaded machine moves them too).
    const probe = pair(size, { inlinePostMaxUs: 1 });
    const ph = probe.a.initializeXfer('READ', probe.local, probe.remote, `atk-b-${engine}`);
    const t: number[] = [];
    for (let i = 0; i < 5; i++) {
      await freshTurn();
      const t0 = performance.now();
      probe.a.transfer(ph);
      await probe.a.wait(ph);
      t.push(performance.now() - t0);
    }
    for (const x of open.splice(0)) x.close();
    t.sort((x, y) => x - y);
    const limitUs = Math.max(50, Math.round(t[2] * 1000 * 0.6));
    const { a, local, remote } = pair(size, { inlinePostMaxUs: limitUs });
    const r = a.initializeXfer('READ', local, remote, `atk-b-${engine}`);
    const w = a.initializeXfer('WRITE', local, remote, `atk-b-${engine}`);
    const seen = { DONE: 0, PROC: 0, ERR: 0 };
    const deadline = performance.now() + 8000;
    let n = 0;
    for (; n < 2000 && performance.now() < deadline; n++) {
      if (n % 50 === 0) await freshTurn();
      const read = n % 3 !== 2;
      if (read) remote.fill(n % 251);
      else local.fill((n * 7) % 251);
      const h = read ? r : w;
      seen[a.transfer(h)]++;
      await a.wait(h, { timeoutMs: 10_000 });
      if (!local.equals(remote)) throw new Error(`posting ${n} (${read ? 'READ' : 'WRITE'}) left wrong bytes`);
    }
    console.log(`[attack] ${n} postings of 2 MiB, limit ${limitUs} us: ${JSON.stringify(seen)}`);
    expect(seen.ERR).toBe(0);
    expect(n).toBeGreaterThan(100);
  });

  it('release, deregister, removeRemoteAgent and close right after a large inline post or a late post', async () => {
    for (const step of ['release', 'deregister', 'remove', 'close'] as const) {
      for (const late of [false, true]) {
        const { a, local, remote, la } = pair(MIB, { inlinePostMaxUs: 1_000_000 });
        const peer = `atk-b-${engine}`;
        const h = a.initializeXfer('READ', local, remote, peer);
        expect(await warm(a, h)).toBe(true);
        await freshTurn();
        remote.fill(late ? 11 : 13);
        if (late) spendBudget();
        const s = a.transfer(h);
        expect(s).toBe(late ? 'PROC' : 'DONE');
        expect(local.equals(remote)).toBe(true);
        const wt = a.wait(h);
        if (step === 'release') a.releaseXferHandle(h);
        else if (step === 'deregister') a.deregisterMemory(la);
        else if (step === 'remove') a.removeRemoteAgent(peer);
        else a.close();
        // The posting was done before the call: its wait resolves, once.
        expect(await settledWithin(wt, 3000)).toBe('resolved');
        if (step !== 'close' && step !== 'release') {
          // A repost now fails with a code, not a crash.
          let code: string | undefined;
          try {
            a.transfer(h);
            await a.wait(h, { timeoutMs: 5000 });
          } catch (e) {
            code = (e as NixlError).code;
          }
          expect(code).toBe('NIXL_ERR_NOT_FOUND');
        }
        for (const x of open.splice(0)) x.close();
      }
    }
  });

  it('notifications of late, inline-by-time and queued posts arrive in the order they were posted', async () => {
    const { a, b, local, remote } = pair(8 * SMALL, { inlinePostMaxUs: 1_000_000 });
    const peer = `atk-b-${engine}`;
    const part = (i: number) => [
      local.subarray(i * SMALL, (i + 1) * SMALL),
      remote.subarray(i * SMALL, (i + 1) * SMALL),
    ];
    const small = [0, 1, 2, 3].map((i) => a.initializeXfer('WRITE', part(i)[0], part(i)[1], peer));
    const big = a.initializeXfer('WRITE', local.subarray(4 * SMALL), remote.subarray(4 * SMALL), peer);
    expect(await warm(a, big)).toBe(true);
    const sent: string[] = [];
    const got: string[] = [];
    for (let round = 0; round < 10; round++) {
      await freshTurn();
      const hs = [small[0], big, small[1], small[2], small[3]];
      // Inline while the budget lasts, then the late one, then the engine's thread.
      for (let i = 0; i < hs.length; i++) {
        if (i === 2) spendBudget();
        const msg = `${round}.${i}`;
        a.transfer(hs[i], msg);
        sent.push(msg);
      }
      await Promise.all(hs.map((h) => a.wait(h, { timeoutMs: 10_000 })));
      expect(local.equals(remote)).toBe(true);
    }
    const until = Date.now() + 10_000;
    while (got.length < sent.length && Date.now() < until) {
      for (const m of b.getNewNotifs().get(a.name) ?? []) got.push(m.toString());
      await new Promise((r) => setTimeout(r, 5));
    }
    expect(got).toEqual(sent);
  });

  it('layered requests whose layers exceed inlinePostMaxBytes, posted many times, inline by time, late or not', async () => {
    const a = agent('atk-lla', { inlinePostMaxBytes: SMALL, inlinePostMaxUs: 1_000_000 });
    const b = agent('atk-llb');
    const BLOCK = 4 * SMALL; // each layer over inlinePostMaxBytes
    const { ma, mb, local, remote } = preparedBlocks(a, b, 4, BLOCK);
    const h = a.makeLayeredXfer('READ', local, [[0], [1], [2], [3]], remote, [[0], [1], [2], [3]]);
    const states: string[] = [];
    for (let k = 1; k <= 40; k++) {
      await freshTurn();
      mb.fill(k);
      if (k % 3 === 0) spendBudget(); // a late post
      if (k % 2 === 0) states.push(a.transfer(h));
      else for (let l = 0; l < 4; l++) states.push(a.postLayer(h, l));
      await a.wait(h, { timeoutMs: 10_000 });
      expect(ma.equals(mb)).toBe(true);
    }
    expect(states).not.toContain('ERR');
  });

  it('the event loop turns during a long loop of transfer(); await wait() over 1-4 MiB requests', async () => {
    // The same loop with inlinePostMaxUs 0 (such posts through the engine's thread) for comparison.
    for (const maxUs of [undefined, 0]) {
      const { a, local, remote } = pair(4 * MIB, { inlinePostMaxBytes: MIB, inlinePostMaxUs: maxUs });
      const peer = `atk-b-${engine}`;
      const sizes = [1, 2, 4].map((m) => m * MIB);
      const hs = sizes.map((n) => a.initializeXfer('READ', local.subarray(0, n), remote.subarray(0, n), peer));
      let last = performance.now();
      let maxGap = 0;
      let ticks = 0;
      const timer = setInterval(() => {
        const now = performance.now();
        maxGap = Math.max(maxGap, now - last);
        last = now;
        ticks++;
      }, 1);
      const states = { DONE: 0, PROC: 0, ERR: 0 };
      const t0 = performance.now();
      let n = 0;
      for (; performance.now() - t0 < 1500; n++) {
        const i = n % hs.length;
        remote.fill(n & 0xff, 0, sizes[i]);
        states[a.transfer(hs[i])]++;
        await a.wait(hs[i], { timeoutMs: 10_000 });
        if (!local.subarray(0, sizes[i]).equals(remote.subarray(0, sizes[i])))
          throw new Error(`posting ${n} left wrong bytes`);
      }
      clearInterval(timer);
      const ms = performance.now() - t0;
      console.log(
        `[attack] loop gap (inlinePostMaxUs ${maxUs ?? 'default'}): ${n} postings in ${ms.toFixed(0)} ms, ${ticks} timer ticks, longest gap ${maxGap.toFixed(2)} ms, ${JSON.stringify(states)}`,
      );
      expect(ticks).toBeGreaterThan(20);
      expect(maxGap).toBeLessThan(1000);
      for (const x of open.splice(0)) x.close();
    }
  });

  it('inline-by-time posts while other large requests are in flight on the engine thread move every byte of each', async () => {
    const N = 4;
    const { a, local, remote } = pair(N * MIB, { inlinePostMaxUs: 1_000_000 });
    const peer = `atk-b-${engine}`;
    const part = (m: Buffer, i: number) => m.subarray(i * MIB, (i + 1) * MIB);
    const hs = Array.from({ length: N }, (_, i) =>
      a.initializeXfer(i % 2 ? 'WRITE' : 'READ', part(local, i), part(remote, i), peer),
    );
    // Odd ones learn an inline-sized time; even ones stay untimed until their first post.
    for (let i = 1; i < N; i += 2) expect(await warm(a, hs[i])).toBe(true);
    const seen = { DONE: 0, PROC: 0, ERR: 0 };
    for (let k = 1; k <= 200; k++) {
      await freshTurn();
      for (let i = 0; i < N; i++) (i % 2 ? part(local, i) : part(remote, i)).fill((k + i) & 0xff);
      // All posted in one turn, none waited before the next: an inline post
      // runs beside the engine thread's posts and polls of the others.
      if (k % 4 === 0) spendBudget();
      for (const h of hs) seen[a.transfer(h)]++;
      await Promise.all(hs.map((h) => a.wait(h, { timeoutMs: 10_000 })));
      for (let i = 0; i < N; i++)
        if (!part(local, i).equals(part(remote, i))) throw new Error(`round ${k}: request ${i} left wrong bytes`);
    }
    console.log(`[attack] concurrent large posts: ${JSON.stringify(seen)}`);
    expect(seen.ERR).toBe(0);
  });

  it('bad inlinePostMaxUs values are refused with NIXL_ERR_INVALID_PARAM', () => {
    for (const bad of ['500', true, Number.POSITIVE_INFINITY, -0.5, {}]) {
      let code: string | undefined;
      try {
        agent('atk-bad', { inlinePostMaxUs: bad as unknown as number });
      } catch (e) {
        code = (e as NixlError).code;
      }
      expect(code, String(bad)).toBe('NIXL_ERR_INVALID_PARAM');
    }
  });
});

describe('inline posts by time to a peer process killed mid-way (loopback)', () => {
  const open: NixlAgent[] = [];
  let peer: Peer | undefined;
  afterEach(() => {
    for (const a of open.splice(0)) a.close();
    if (peer && peer.proc.exitCode === null) peer.kill();
    peer = undefined;
  });

  it('every posting either moved the right bytes (DONE) or failed with NIXL_ERR_REMOTE_DISCONNECT, inline, late or not', async () => {
    const size = 2 * MIB;
    const a = new NixlAgent('atk-kill', { engine: 'loopback', inlinePostMaxBytes: SMALL, inlinePostMaxUs: 1_000_000 });
    open.push(a);
    const mem = allocate(size);
    a.registerMemory(mem);
    peer = new Peer('peer.js');
    const init = await peer.request<{ md: Uint8Array; addr: bigint }>({
      cmd: 'init',
      name: 'atk-child',
      size,
      shared: false,
      seed: 4,
    });
    a.addRemoteAgent(Buffer.from(init.md));
    const h = a.initializeXfer('READ', mem, DescList.from([{ addr: init.addr, len: size }]), 'atk-child');
    const outcomes: string[] = [];
    const killAt = 12;
    for (let k = 0; k < 30; k++) {
      if (k === killAt) peer.kill(); // no wait for its exit: posts race the dying process
      await freshTurn();
      if (k % 2 === 1) spendBudget(); // a late post
      mem.fill(0);
      const s = a.transfer(h);
      let out: string;
      try {
        await a.wait(h, { timeoutMs: 10_000 });
        out = 'DONE';
        if (!checkPattern(mem, 4)) throw new Error(`posting ${k} (${s}) read DONE with wrong bytes`);
      } catch (e) {
        out = (e as NixlError).code ?? String(e);
      }
      outcomes.push(`${k}:${s}:${out}`);
    }
    await peer.exit();
    const bad = outcomes.filter((o) => !o.endsWith(':DONE') && !o.endsWith(':NIXL_ERR_REMOTE_DISCONNECT'));
    expect(bad).toEqual([]);
    expect(outcomes.slice(0, killAt).every((o) => o.endsWith(':DONE'))).toBe(true);
    expect(outcomes.at(-1)).toMatch(/NIXL_ERR_REMOTE_DISCONNECT$/);
  });
});
