// One suite, every engine: the loopback engine always; the NIXL engine when
// the addon was built against an installed NIXL (else skipped, saying why).
// NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, NixlError, type XferHandle, allocate, engines } from '../../lib';
import { Peer, freePort } from '../helpers';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const { setupAgent } = require('../fixtures/conformance-setup');

const wanted = process.env.NIXL_NODE_ENGINE ? [process.env.NIXL_NODE_ENGINE] : ['loopback', 'nixl'];
const skipWhy = (engine: string): string | undefined =>
  engine === 'nixl' && !engines.includes('nixl')
    ? 'NIXL is not compiled in: build with NIXL_PREFIX=<nixl install> npm run build'
    : undefined;

for (const e of wanted) {
  const why = skipWhy(e);
  if (why) console.warn(`conformance suite: ${e} engine skipped: ${why}`);
}

describe.each(wanted)('conformance: %s engine', (engine) => {
  const why = skipWhy(engine);
  if (why) {
    it.skip(`skipped: ${why}`, () => {});
    return;
  }
  const open: NixlAgent[] = [];
  const mk = (name: string, loopbackOptions?: { testDelayUs?: number; inlinePostMaxUs?: number }): NixlAgent => {
    const a = setupAgent(NixlAgent, name, engine, loopbackOptions) as NixlAgent;
    open.push(a);
    return a;
  };
  afterEach(() => {
    for (const a of open.splice(0)) a.close();
  });
  /** Two agents, each with `size` bytes of registered memory. */
  const pair = (size: number, loopbackOptions?: { testDelayUs?: number; inlinePostMaxUs?: number }) => {
    const a = mk('conf-a', loopbackOptions);
    const b = mk('conf-b');
    const ma = allocate(size);
    const mb = allocate(size);
    a.registerMemory(ma);
    b.registerMemory(mb);
    return { a, b, ma, mb };
  };

  /** A pair whose b holds `size` bytes of `mark`, loaded by a; `remote` is all of b's memory. */
  const loaded = (size: number, mark: number, loopbackOptions?: { testDelayUs?: number; inlinePostMaxUs?: number }) => {
    const p = pair(size, loopbackOptions);
    p.mb.fill(mark);
    p.a.addRemoteAgent(p.b.getAgentMetadata());
    return { ...p, remote: DescList.from([{ addr: DescList.from(p.mb).addr(0), len: size }]) };
  };

  /** A handle made from a stale list: refused at make, or made and refused at post; NIXL_ERR_NOT_FOUND either way. */
  const expectStale = (a: NixlAgent, make: () => XferHandle) => {
    let h: XferHandle;
    try {
      h = make();
    } catch (e) {
      expect((e as NixlError).code).toBe('NIXL_ERR_NOT_FOUND');
      return;
    }
    expect(() => a.transfer(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    a.releaseXferHandle(h);
  };

  it('reports its engine and backend', () => {
    const a = mk('conf-a');
    expect(a.engine).toBe(engine);
    expect(a.getBackends().length).toBe(1);
    expect(a.getPluginList()).toContain(a.getBackends()[0]);
  });

  it('prepped READ and WRITE between two agents, with notifications and telemetry', async () => {
    const a = mk('conf-a');
    const b = mk('conf-b');
    const block = 64 << 10;
    const la = allocate(8 * block);
    const lb = allocate(8 * block);
    for (let i = 0; i < lb.length; i++) lb[i] = (i * 7) & 0xff;
    a.registerMemory(la);
    b.registerMemory(lb);
    expect(a.addRemoteAgent(b.getAgentMetadata())).toBe('conf-b');
    b.addRemoteAgent(a.getAgentMetadata());
    const blocks = (buf: Buffer) =>
      DescList.from(Array.from({ length: 8 }, (_, i) => buf.subarray(i * block, (i + 1) * block)));
    const l = a.prepXferDlist('NIXL_INIT_AGENT', blocks(la));
    const r = a.prepXferDlist(
      'conf-b',
      DescList.from(
        Array.from({ length: 8 }, (_, i) => ({ addr: DescList.from(lb).addr(0) + BigInt(i * block), len: block })),
      ),
    );
    const h = a.makePreppedXfer('READ', l, [0, 1, 2, 3], r, [7, 6, 5, 4], 'conf-read');
    a.transfer(h);
    await a.wait(h, { timeoutMs: 10_000 });
    for (let i = 0; i < 4; i++)
      expect(la.subarray(i * block, (i + 1) * block).equals(lb.subarray((7 - i) * block, (8 - i) * block))).toBe(true);
    expect((await b.waitForNotif({ agent: 'conf-a', msg: 'conf-read' }, { timeoutMs: 10_000 })).msg.toString()).toBe(
      'conf-read',
    );
    const t = a.getXferTelemetry(h);
    expect(t.totalBytes).toBe(4 * block);
    la.fill(0xee, 0, block);
    const w = a.makePreppedXfer('WRITE', l, [0], r, [0]);
    a.transfer(w);
    await a.wait(w, { timeoutMs: 10_000 });
    expect(lb.subarray(0, block).every((v) => v === 0xee)).toBe(true);
    a.sendNotif('conf-b', 'direct');
    await b.waitForNotif({ msg: 'direct' }, { timeoutMs: 10_000 });
    a.releaseXferHandle(h);
    a.releaseXferHandle(w);
    a.releaseDlistHandle(l);
    a.releaseDlistHandle(r);
  });

  it('a post never blocks the event loop: transfer() returns PROC, the loop turns while 256 MiB move', async () => {
    // One host, one process: UCX's cma transport would finish this READ inside
    // postXferReq; the engine must post it from its own thread.
    const size = 256 << 20;
    const { a, b, ma, remote } = loaded(size, 0x5a);
    b.addRemoteAgent(a.getAgentMetadata());
    const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    // Lag probe: the longest time the loop went without a turn while the copy ran.
    let turns = 0;
    let done = false;
    let last = performance.now();
    let maxGap = 0;
    const probe = () => {
      if (done) return;
      const now = performance.now();
      maxGap = Math.max(maxGap, now - last);
      last = now;
      turns++;
      setImmediate(probe);
    };
    const t0 = performance.now();
    const state = a.transfer(h);
    const postMs = performance.now() - t0;
    setImmediate(probe);
    await a.wait(h, { timeoutMs: 30_000 });
    done = true;
    const copyMs = performance.now() - t0;
    console.log(
      `${engine}: transfer() ${postMs.toFixed(3)} ms, copy ${copyMs.toFixed(1)} ms, longest loop gap ${maxGap.toFixed(2)} ms over ${turns} turns`,
    );
    expect(state).toBe('PROC');
    expect(turns).toBeGreaterThan(0);
    // A post that ran the copy would block for all of it; allow any scheduling noise short of that.
    expect(postMs).toBeLessThan(copyMs / 2);
    expect(maxGap).toBeLessThan(copyMs * 0.9);
    expect(ma[0]).toBe(0x5a);
    expect(ma[size - 1]).toBe(0x5a);
    a.releaseXferHandle(h);
  });

  it('10,000 small transfers back to back leave the loop turning (the longest gap reported)', async () => {
    // Small transfers finish inside their post (inlinePostMaxBytes), so a
    // loop of transfer() + await wait() could run on microtasks alone and
    // never let the event loop turn; the agent lets it turn between batches.
    const { a, b, ma, remote } = loaded(1 << 20, 0x3c);
    b.addRemoteAgent(a.getAgentMetadata());
    const block = 4096;
    const handles = [0, 1, 2, 3].map((i) =>
      a.initializeXfer(
        i % 2 ? 'WRITE' : 'READ',
        ma.subarray(i * block, (i + 1) * block),
        DescList.from([{ addr: remote.addr(0) + BigInt(i * block), len: block }]),
        'conf-b',
      ),
    );
    let turns = 0;
    let done = false;
    let last = performance.now();
    let maxGap = 0;
    const probe = () => {
      const now = performance.now();
      maxGap = Math.max(maxGap, now - last);
      last = now;
      if (done) return;
      turns++;
      setImmediate(probe);
    };
    setImmediate(probe);
    const t0 = performance.now();
    for (let i = 0; i < 10_000; i++) {
      const h = handles[i % handles.length];
      a.transfer(h);
      await a.wait(h, { timeoutMs: 10_000 });
    }
    const totalMs = performance.now() - t0;
    done = true;
    await new Promise((r) => setImmediate(r)); // the probe's last look
    console.log(
      `${engine}: 10,000 transfers of 4 KiB in ${totalMs.toFixed(1)} ms (${((totalMs * 1000) / 10_000).toFixed(2)} us each), longest loop gap ${maxGap.toFixed(2)} ms over ${turns} turns`,
    );
    expect(ma[0]).toBe(0x3c);
    // Microtasks alone would give one turn, at the end, and a gap as long as the run.
    expect(turns).toBeGreaterThanOrEqual(2);
    expect(maxGap).toBeLessThan(totalMs * 0.75);
    for (const h of handles) a.releaseXferHandle(h);
  });

  it('by default a small transfer is posted on the calling thread and is DONE when transfer() returns', async () => {
    // Both engines post up to inlinePostMaxBytes inline (NIXL as its Python
    // API does); on one host the copy finishes inside the post (UCX's cma,
    // the loopback mapping), so no completion event is needed.
    const { a, ma, remote } = loaded(4096, 0x6e);
    const h = a.initializeXfer('READ', ma.subarray(0, 4096), remote, 'conf-b');
    try {
      for (let i = 0; i < 20; i++) {
        ma.fill(0);
        await new Promise<void>((r) => setImmediate(r)); // a turn with its inline budget whole
        expect(a.transfer(h)).toBe('DONE');
        expect(ma[0]).toBe(0x6e);
        expect(ma[4095]).toBe(0x6e);
        await a.wait(h, { timeoutMs: 10_000 });
      }
    } finally {
      a.releaseXferHandle(h);
    }
  });

  it('a wait already pending settles when checkXferState is what finds the transfer done', async () => {
    // NIXL's checkXferState asks NIXL directly (check_xfer_state) and may be
    // the one that finishes a request: no completion event follows then, so
    // the state check itself must settle the waits.
    // Above inlinePostMaxBytes, and never inline by time: every post from the engine's thread.
    const size = 8 << 20;
    const { a, ma, remote } = loaded(size, 0x2d, { inlinePostMaxUs: 0 });
    const h = a.initializeXfer('READ', ma, remote, 'conf-b');
    try {
      for (let i = 0; i < 30; i++) {
        ma.fill(0);
        a.transfer(h);
        const waited = a.wait(h, { timeoutMs: 10_000 });
        while (a.checkXferState(h) === 'PROC') {}
        await waited;
        expect(ma[0]).toBe(0x2d);
        expect(ma[size - 1]).toBe(0x2d);
      }
    } finally {
      a.releaseXferHandle(h);
    }
  });

  it('a re-posted transfer resolves only when its own posting is done (100 postings, some waits late)', async () => {
    const BLOCK = 256 << 10;
    const N = 16;
    const { a, b, ma, mb } = pair(BLOCK * N);
    a.addRemoteAgent(b.getAgentMetadata());
    b.addRemoteAgent(a.getAgentMetadata());
    const blocks = (m: Buffer) =>
      DescList.from(Array.from({ length: N }, (_, i) => m.subarray(i * BLOCK, (i + 1) * BLOCK)));
    const l = a.prepXferDlist('NIXL_INIT_AGENT', blocks(ma));
    const r = a.prepXferDlist(
      'conf-b',
      DescList.from(
        Array.from({ length: N }, (_, i) => ({ addr: DescList.from(mb).addr(0) + BigInt(i * BLOCK), len: BLOCK })),
      ),
    );
    const idx = Uint32Array.from({ length: N }, (_, i) => i);
    const h = a.makePreppedXfer('READ', l, idx, r, idx);
    let stale = 0;
    for (let i = 0; i < 100; i++) {
      const mark = (i * 7 + 1) & 0xff;
      mb.fill(mark);
      a.transfer(h);
      if (i % 2 === 1) while (a.checkXferState(h) === 'PROC') await new Promise((res) => setImmediate(res));
      await a.wait(h, { timeoutMs: 10_000 });
      for (let k = 0; k < N; k++) if (ma[k * BLOCK] !== mark || ma[(k + 1) * BLOCK - 1] !== mark) stale++;
    }
    expect(stale).toBe(0);
    a.releaseXferHandle(h);
  });

  it('releasing a posted transfer settles its waiters with NIXL_ERR_CANCELED; the agent goes on', async () => {
    const size = 64 << 20;
    const { a, b, ma, mb } = pair(size);
    a.addRemoteAgent(b.getAgentMetadata());
    const remote = DescList.from([{ addr: DescList.from(mb).addr(0), len: size }]);
    for (let i = 0; i < 5; i++) {
      const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
      a.transfer(h);
      const w = a.wait(h, { timeoutMs: 10_000 }).then(
        () => 'DONE',
        (e) => (e as NixlError).code,
      );
      a.releaseXferHandle(h);
      expect(['DONE', 'NIXL_ERR_CANCELED']).toContain(await w);
      expect(() => a.checkXferState(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    }
    mb.fill(9);
    await a.read(DescList.from(ma), remote, 'conf-b', { timeoutMs: 10_000 });
    expect(ma[size - 1]).toBe(9);
  });

  it('a post to a removed remote agent fails with NIXL_ERR_NOT_FOUND (at the call, or in wait)', async () => {
    const { a, b, ma, mb } = pair(1 << 20);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer(
      'READ',
      DescList.from(ma),
      DescList.from([{ addr: DescList.from(mb).addr(0), len: 1 << 20 }]),
      'conf-b',
    );
    a.removeRemoteAgent('conf-b');
    let code: string | undefined;
    try {
      a.transfer(h);
      await a.wait(h, { timeoutMs: 10_000 });
    } catch (e) {
      code = (e as NixlError).code;
    }
    expect(code).toMatch(/NIXL_ERR_(NOT_FOUND|BACKEND|INVALID_PARAM|REMOTE_DISCONNECT)/);
  });

  it('memory a queued or running transfer uses cannot be deregistered (NIXL_ERR_NOT_ALLOWED); after it, it can', async () => {
    // transfer() only queues: the copy starts on the engine's thread a moment
    // later. Deregistering in that moment would free what the copy uses. The
    // loopback worker waits 200 ms before each request, so the transfer is
    // still queued when deregistration is tried: without the wait a JS thread
    // descheduled for the copy's few ms on a loaded machine found it done.
    const size = 64 << 20;
    const { a, ma, remote } = loaded(size, 0x33, { testDelayUs: 200_000 });
    const extra = allocate(4096);
    const other = a.registerMemory(extra);
    const used = a.registerMemory(allocate(64)); // registered after ma: still idle
    for (let i = 0; i < 3; i++) {
      const reg = a.registerMemory(ma);
      const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
      a.transfer(h);
      expect(() => a.deregisterMemory(reg)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_ALLOWED' }));
      await a.wait(h, { timeoutMs: 10_000 });
      expect(ma[size - 1]).toBe(0x33);
      a.deregisterMemory(reg);
      a.releaseXferHandle(h);
    }
    // Memory no transfer uses deregisters while others run.
    const reg = a.registerMemory(ma);
    const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    a.transfer(h);
    a.deregisterMemory(other);
    a.deregisterMemory(used);
    await a.wait(h, { timeoutMs: 10_000 });
    a.releaseXferHandle(h);
    a.deregisterMemory(reg);
  });

  it('a handle over memory deregistered since it was made is refused at post (NIXL_ERR_NOT_FOUND), re-registered or not', async () => {
    const size = 1 << 20;
    const { a, remote } = loaded(size, 0x44);
    const la = allocate(size);
    const reg = a.registerMemory(la);
    const h = a.initializeXfer('READ', DescList.from(la), remote, 'conf-b');
    const ld = a.prepXferDlist('NIXL_INIT_AGENT', DescList.from(la));
    const rd = a.prepXferDlist('conf-b', remote);
    const p = a.makePreppedXfer('READ', ld, [0], rd, [0]);
    a.deregisterMemory(reg);
    for (const x of [h, p])
      expect(() => a.transfer(x)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    // The prepped local list is as stale as the handles made from it: refused
    // when the handle is made (nixl) or when it is posted (loopback).
    expectStale(a, () => a.makePreppedXfer('READ', ld, [0], rd, [0]));
    a.registerMemory(la); // the same bytes again: a new registration the old handles do not hold
    for (const x of [h, p])
      expect(() => a.transfer(x)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    expect(la[0]).toBe(0);
    const fresh = a.initializeXfer('READ', DescList.from(la), remote, 'conf-b');
    a.transfer(fresh);
    await a.wait(fresh, { timeoutMs: 10_000 });
    expect(la[size - 1]).toBe(0x44);
    for (const x of [h, p, fresh]) a.releaseXferHandle(x);
    a.releaseDlistHandle(ld);
    a.releaseDlistHandle(rd);
  });

  // A post checks the request's memory and agent on every post, not only on
  // its first (the NIXL engine remembers that they were there at a post).
  it('a handle posted before its memory was deregistered, or its agent removed, is refused at its next post (NIXL_ERR_NOT_FOUND)', async () => {
    const size = 1 << 20;
    const { a, b, ma, remote } = loaded(size, 0x77);
    const la = allocate(size);
    const reg = a.registerMemory(la);
    const h = a.initializeXfer('READ', DescList.from(la), remote, 'conf-b');
    const g = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    for (const x of [h, g, h, g]) {
      a.transfer(x);
      await a.wait(x, { timeoutMs: 10_000 });
    }
    a.deregisterMemory(reg);
    expect(() => a.transfer(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    a.transfer(g); // its memory is still registered
    await a.wait(g, { timeoutMs: 10_000 });
    a.removeRemoteAgent('conf-b');
    a.addRemoteAgent(b.getAgentMetadata());
    expect(() => a.transfer(g)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    for (const x of [h, g]) a.releaseXferHandle(x);
  });

  it("a handle knows the bytes its request moves (the inline budget's clock counts them)", () => {
    const { a, mb } = loaded(1 << 20, 0);
    const la = allocate(1 << 20);
    a.registerMemory(la);
    const at = (m: Uint8Array, off: number, len: number) => ({ addr: DescList.from(m).addr(0) + BigInt(off), len });
    const h = a.initializeXfer('READ', DescList.from([at(la, 0, 12345)]), DescList.from([at(mb, 0, 12345)]), 'conf-b');
    expect(h.bytes).toBe(12345);
    const ld = a.prepXferDlist('NIXL_INIT_AGENT', DescList.from([at(la, 0, 4096), at(la, 8192, 100)]));
    const rd = a.prepXferDlist('conf-b', DescList.from([at(mb, 0, 4096), at(mb, 8192, 100)]));
    const p = a.makePreppedXfer('READ', ld, [1, 0, 1], rd, [1, 0, 1]);
    expect(p.bytes).toBe(4296);
    for (const x of [h, p]) a.releaseXferHandle(x);
    a.releaseDlistHandle(ld);
    a.releaseDlistHandle(rd);
  });

  it('a handle made before removeRemoteAgent is refused at post after the agent is loaded again (NIXL_ERR_NOT_FOUND)', async () => {
    const size = 1 << 20;
    const { a, b, ma, remote } = loaded(size, 0x55);
    const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    const rd = a.prepXferDlist('conf-b', remote);
    a.removeRemoteAgent('conf-b');
    a.addRemoteAgent(b.getAgentMetadata());
    expect(() => a.transfer(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    const ld = a.prepXferDlist('NIXL_INIT_AGENT', DescList.from(ma));
    expectStale(a, () => a.makePreppedXfer('READ', ld, [0], rd, [0]));
    const fresh = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    a.transfer(fresh);
    await a.wait(fresh, { timeoutMs: 10_000 });
    expect(ma[size - 1]).toBe(0x55);
    for (const x of [h, fresh]) a.releaseXferHandle(x);
    a.releaseDlistHandle(ld);
    a.releaseDlistHandle(rd);
  });

  it('removeRemoteAgent while a transfer to it is queued or running: refused on nixl (NIXL_ERR_NOT_ALLOWED), finishes on loopback', async () => {
    const size = 64 << 20;
    const { a, ma, remote } = loaded(size, 0x66);
    const h = a.initializeXfer('READ', DescList.from(ma), remote, 'conf-b');
    a.transfer(h);
    if (engine === 'nixl') {
      // NIXL frees the agent's connection and keys at once: refused until the transfer is over.
      expect(() => a.removeRemoteAgent('conf-b')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_ALLOWED' }));
      await a.wait(h, { timeoutMs: 10_000 });
      a.removeRemoteAgent('conf-b');
    } else {
      // The loopback engine's requests hold the peer's mapping: the one in flight finishes.
      a.removeRemoteAgent('conf-b');
      await a.wait(h, { timeoutMs: 10_000 });
    }
    expect(ma[size - 1]).toBe(0x66);
    expect(() => a.transfer(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    a.releaseXferHandle(h);
  });

  it("random post / re-post / wait / release / refill sequences (fast-check): a wait is its own posting's", async () => {
    const fc = await import('fast-check');
    const BLOCK = 64 << 10;
    const H = 4; // handles; handle k writes local blocks 2k and 2k+1
    const R = 8; // remote blocks
    const { a, b, ma, mb } = pair(Math.max(2 * H, R) * BLOCK);
    a.addRemoteAgent(b.getAgentMetadata());
    const l = a.prepXferDlist(
      'NIXL_INIT_AGENT',
      DescList.from(Array.from({ length: 2 * H }, (_, i) => ma.subarray(i * BLOCK, (i + 1) * BLOCK))),
    );
    const rbase = DescList.from(mb).addr(0);
    const r = a.prepXferDlist(
      'conf-b',
      DescList.from(Array.from({ length: R }, (_, j) => ({ addr: rbase + BigInt(j * BLOCK), len: BLOCK }))),
    );
    const op = fc.oneof(
      fc.record({ t: fc.constant('post' as const), k: fc.nat(H - 1) }),
      fc.record({ t: fc.constant('wait' as const), k: fc.nat(H - 1) }),
      fc.record({ t: fc.constant('release' as const), k: fc.nat(H - 1) }),
      fc.record({ t: fc.constant('refill' as const) }),
      fc.record({ t: fc.constant('state' as const), k: fc.nat(H - 1) }),
    );
    let gen = 1;
    await fc.assert(
      fc.asyncProperty(
        fc.array(op, { minLength: 1, maxLength: 30 }),
        fc.array(fc.nat(R - 1), { minLength: 2 * H, maxLength: 2 * H }),
        async (ops, picks) => {
          // Handle k reads remote blocks picks[2k], picks[2k+1] into its two local blocks.
          const make = (k: number) =>
            a.makePreppedXfer('READ', l, [2 * k, 2 * k + 1], r, [picks[2 * k], picks[2 * k + 1]]);
          const hs = Array.from({ length: H }, (_, k) => ({
            h: make(k),
            posted: false,
            want: -1,
          }));
          const remoteGen = Array(R).fill(0);
          const refill = () => {
            gen = (gen % 250) + 1;
            for (let j = 0; j < R; j++) {
              remoteGen[j] = (gen + j) & 0xff;
              mb.fill(remoteGen[j], j * BLOCK, (j + 1) * BLOCK);
            }
          };
          refill();
          const check = (k: number, want: number) => {
            for (const i of [2 * k, 2 * k + 1]) {
              const j = picks[i];
              const w = (want + j) & 0xff;
              expect(ma[i * BLOCK], `handle ${k} block ${i}`).toBe(w);
              expect(ma[(i + 1) * BLOCK - 1]).toBe(w);
            }
          };
          const settleAll = async () => {
            for (const [k, x] of hs.entries()) {
              if (!x.posted) continue;
              await a.wait(x.h, { timeoutMs: 10_000 });
              check(k, x.want);
              x.posted = false;
            }
          };
          for (const o of ops) {
            if (o.t === 'refill') {
              await settleAll(); // nothing in flight reads what changes
              refill();
            } else if (o.t === 'post') {
              const x = hs[o.k];
              if (x.posted) {
                // Re-posting an active request is refused, or (finished) accepted as a new posting.
                try {
                  a.transfer(x.h);
                } catch (e) {
                  expect((e as NixlError).code).toBe('NIXL_ERR_REPOST_ACTIVE');
                  continue;
                }
              } else a.transfer(x.h);
              x.posted = true;
              x.want = gen;
            } else if (o.t === 'wait') {
              const x = hs[o.k];
              if (!x.posted) {
                // Never posted: NIXL_ERR_NOT_POSTED; posted and settled before: resolves at once.
                const res = await a.wait(x.h).then(
                  () => 'DONE',
                  (e) => (e as NixlError).code,
                );
                expect(res).toBe(x.want < 0 ? 'NIXL_ERR_NOT_POSTED' : 'DONE');
                continue;
              }
              await a.wait(x.h, { timeoutMs: 10_000 });
              check(o.k, x.want);
              x.posted = false;
            } else if (o.t === 'release') {
              const x = hs[o.k];
              const w = x.posted
                ? a.wait(x.h, { timeoutMs: 10_000 }).then(
                    () => 'DONE',
                    (e) => (e as NixlError).code,
                  )
                : undefined;
              a.releaseXferHandle(x.h);
              if (w) expect(['DONE', 'NIXL_ERR_CANCELED']).toContain(await w);
              await expect(a.wait(x.h)).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_FOUND' });
              hs[o.k] = { h: make(o.k), posted: false, want: -1 };
            } else {
              const x = hs[o.k];
              if (x.want < 0)
                expect(() => a.checkXferState(x.h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_POSTED' }));
              else expect(['PROC', 'DONE']).toContain(a.checkXferState(x.h));
            }
          }
          await settleAll();
          for (const x of hs) a.releaseXferHandle(x.h);
        },
      ),
      { numRuns: Number(process.env.FC_RUNS_CONFORMANCE ?? 40) },
    );
  }, 120_000);

  it('two processes: metadata over a pipe, blocks both ways, bytes verified', async () => {
    const size = 1 << 20;
    const a = mk('conf-parent');
    const mem = allocate(size);
    for (let i = 0; i < size; i++) mem[i] = (i * 3 + 1) & 0xff;
    a.registerMemory(mem);
    const peer = new Peer('conformance-peer.js', [engine]);
    try {
      const init = await peer.request<{ md: Uint8Array; addr: bigint }>({ cmd: 'init', size });
      expect(a.addRemoteAgent(Buffer.from(init.md))).toBe('conf-child');
      await peer.request({ cmd: 'load', md: a.getAgentMetadata() });
      // parent pulls the child's first quarter into its second quarter
      await a.read(mem.subarray(size / 4, size / 2), [{ addr: init.addr, len: size / 4 }], 'conf-child', {
        notifMsg: 'parent-read',
        timeoutMs: 10_000,
      });
      for (let i = 0; i < size / 4; i++)
        if (mem[size / 4 + i] !== ((i * 13 + 5) & 0xff)) throw new Error(`byte ${i} differs`);
      expect(await peer.request({ cmd: 'notif', msg: 'parent-read' })).toEqual({
        agent: 'conf-parent',
        msg: 'parent-read',
      });
      // child pulls the parent's first 64 KiB
      const got = await peer.request<{ data: Uint8Array }>({
        cmd: 'read',
        addr: DescList.from(mem).addr(0),
        len: 65536,
        size,
        remote: 'conf-parent',
      });
      expect(Buffer.from(got.data).equals(mem.subarray(0, 65536))).toBe(true);
      await a.waitForNotif({ agent: 'conf-child', msg: 'child-read' }, { timeoutMs: 10_000 });
    } finally {
      peer.send({ cmd: 'exit' });
      await peer.exit();
    }
  }, 60_000);

  it('partial metadata: registrations arrive piecewise, checkRemoteMetadata tells what is known', async () => {
    const { a, b, ma: m1, mb: dst } = pair(65536);
    const m2 = allocate(65536);
    m2.fill(0x42);
    a.registerMemory(m2);
    expect(b.checkRemoteMetadata('conf-a')).toBe(false);
    expect(b.addRemoteAgent(a.getPartialAgentMetadata(m1, { includeConnInfo: true }))).toBe('conf-a');
    expect(b.checkRemoteMetadata('conf-a')).toBe(true);
    expect(b.checkRemoteMetadata('conf-a', [m1])).toBe(true);
    expect(b.checkRemoteMetadata('conf-a', [m2])).toBe(false);
    b.addRemoteAgent(a.getPartialAgentMetadata(m2));
    expect(b.checkRemoteMetadata('conf-a', [m2])).toBe(true);
    b.makeConnection('conf-a');
    await b.read(dst, m2, 'conf-a', { timeoutMs: 10_000 });
    expect(dst.every((v) => v === 0x42)).toBe(true);
    expect(() => b.makeConnection('nobody')).toThrow(NixlError);
  });

  it('queryMemory and estimateXferCost answer or say they are not supported', async () => {
    const a = mk('conf-a');
    const b = mk('conf-b');
    const m = allocate(65536);
    a.registerMemory(m);
    const other = allocate(4096);
    const tryIt = <T>(f: () => T): T | NixlError => {
      try {
        return f();
      } catch (e) {
        expect(e).toBeInstanceOf(NixlError);
        return e as NixlError;
      }
    };
    const q = tryIt(() => a.queryMemory([m, other], { backends: a.getBackends() }));
    if (engine === 'loopback') expect(q).toEqual([{ registered: 'true' }, null]);
    else if (q instanceof NixlError) expect(q.code).toBe('NIXL_ERR_NOT_SUPPORTED');
    else expect((q as unknown[]).length).toBe(2);
    const bm = allocate(65536);
    b.registerMemory(bm);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer('READ', m, bm, 'conf-b');
    const c = tryIt(() => a.estimateXferCost(h));
    if (c instanceof NixlError) expect(c.code).toBe('NIXL_ERR_NOT_SUPPORTED');
    else expect(c.durationUs).toBeGreaterThanOrEqual(0);
    a.releaseXferHandle(h);
  });

  it("NIXL's own metadata exchange (listener): send, fetch, invalidate", async () => {
    if (engine === 'loopback') {
      const a = mk('conf-a');
      for (const f of [
        () => a.sendLocalMetadata({ ip: '127.0.0.1', port: 1 }),
        () => a.fetchRemoteMetadata('x', { ip: '127.0.0.1', port: 1 }),
        () => a.invalidateLocalMetadata({ ip: '127.0.0.1', port: 1 }),
      ]) {
        expect(f).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_SUPPORTED' }));
      }
      return;
    }
    const ports: number[] = [];
    while (ports.length < 3) {
      const p = await freePort();
      if (!ports.includes(p)) ports.push(p);
    }
    const [pa, pb, pc] = ports;
    const listen = (name: string, port: number) => {
      const x = new NixlAgent(name, {
        engine: 'nixl',
        listenPort: port,
        backendParams: { UCX: { ucx_error_handling_mode: 'none' } },
      });
      open.push(x);
      return x;
    };
    const a = listen('conf-la', pa);
    const b = listen('conf-lb', pb);
    a.registerMemory(allocate(4096));
    const until = async (f: () => boolean) => {
      for (let i = 0; i < 100 && !f(); i++) await new Promise((r) => setTimeout(r, 50));
      return f();
    };
    a.sendLocalMetadata({ ip: '127.0.0.1', port: pb });
    expect(await until(() => b.checkRemoteMetadata('conf-la'))).toBe(true);
    const c = listen('conf-lc', pc); // the answer to a fetch comes back through the asker's listener
    c.fetchRemoteMetadata('conf-la', { ip: '127.0.0.1', port: pa });
    expect(await until(() => c.checkRemoteMetadata('conf-la'))).toBe(true);
    a.invalidateLocalMetadata({ ip: '127.0.0.1', port: pb });
    expect(await until(() => !b.checkRemoteMetadata('conf-la'))).toBe(true);
  });

  it('bad descriptors and handles are NixlErrors with codes, nothing copied', () => {
    const { a, b, ma: la, mb: lb } = pair(4096);
    la.fill(1);
    a.addRemoteAgent(b.getAgentMetadata());
    const expectCode = (f: () => unknown, codes: string[]) => {
      try {
        f();
      } catch (e) {
        expect(e).toBeInstanceOf(NixlError);
        expect(codes).toContain((e as NixlError).code);
        return;
      }
      throw new Error('did not throw');
    };
    expectCode(
      () => a.initializeXfer('READ', Buffer.alloc(16), [{ addr: DescList.from(lb).addr(0), len: 16 }], 'conf-b'),
      ['NIXL_ERR_NOT_FOUND'],
    );
    expectCode(
      () => a.initializeXfer('READ', la.subarray(0, 16), [{ addr: DescList.from(lb).addr(0), len: 16 }], 'nobody'),
      ['NIXL_ERR_NOT_FOUND'],
    );
    expectCode(() => a.prepXferDlist('nobody', [{ addr: 4096n, len: 16 }]), ['NIXL_ERR_NOT_FOUND']);
    // Indices past the prepared lists, up to 2^32 - 1: an error, never a read past the engine's tables.
    const lp = a.prepXferDlist('NIXL_INIT_AGENT', DescList.from(la.subarray(0, 16)));
    const rp = a.prepXferDlist('conf-b', [{ addr: DescList.from(lb).addr(0), len: 16 }]);
    for (const bad of [1, 0xffff, 0xffffffff])
      for (const [li, ri] of [
        [bad, 0],
        [0, bad],
      ])
        expectCode(
          () => a.makePreppedXfer('READ', lp, [li], rp, [ri]),
          ['NIXL_ERR_INVALID_PARAM', 'NIXL_ERR_NOT_FOUND'],
        );
    a.releaseDlistHandle(lp);
    a.releaseDlistHandle(rp);
    const h = a.initializeXfer('READ', la.subarray(0, 16), [{ addr: DescList.from(lb).addr(0), len: 16 }], 'conf-b');
    a.releaseXferHandle(h);
    expectCode(() => a.releaseXferHandle(h), ['NIXL_ERR_NOT_FOUND']);
    expect(la.every((v) => v === 1)).toBe(true);
  });
});
