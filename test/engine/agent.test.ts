import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, NixlError, allocate, engines } from '../../lib';
import { checkPattern, pattern } from '../helpers';

const open: NixlAgent[] = [];
function agent(name: string, opts = {}): NixlAgent {
  const a = new NixlAgent(name, { engine: 'loopback', ...opts });
  open.push(a);
  return a;
}
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

function pair(block = 4096, blocks = 8) {
  const a = agent('decode');
  const b = agent('prefill');
  const local = Buffer.alloc(block * blocks);
  const remote = allocate(block * blocks);
  pattern(remote, 3);
  a.registerMemory(local);
  b.registerMemory(remote);
  expect(a.addRemoteAgent(b.getAgentMetadata())).toBe('prefill');
  expect(b.addRemoteAgent(a.getAgentMetadata())).toBe('decode');
  return { a, b, local, remote, block, blocks };
}

describe('agent basics', () => {
  it('reports the engine and its plugins', () => {
    const a = agent('x');
    expect(a.engine).toBe('loopback');
    expect(engines).toContain('loopback');
    expect(a.getPluginList()).toEqual(['LOOPBACK']);
    expect(a.getBackends()).toEqual(['LOOPBACK']);
    expect(a.getPluginParams('LOOPBACK').memTypes).toEqual(['DRAM']);
    expect(() => a.createBackend('UCX')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    expect(() => a.createBackend('LOOPBACK')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_ALLOWED' }));
  });

  it("engine 'nixl' without NIXL compiled in is a clear error", () => {
    if (engines.includes('nixl')) return;
    let err: unknown;
    try {
      new NixlAgent('n', { engine: 'nixl' });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(NixlError);
    expect((err as NixlError).code).toBe('NIXL_ERR_NOT_SUPPORTED');
    expect((err as NixlError).message).toMatch(/NIXL_PREFIX/);
  });

  it('reads and writes with the promise forms, bytes verified', async () => {
    const { a, local, remote } = pair();
    await a.read(local, remote, 'prefill');
    expect(local.equals(remote)).toBe(true);
    pattern(local, 9);
    await a.write(local, remote, 'prefill');
    expect(checkPattern(remote, 9)).toBe(true);
  });

  it('prepped dlists: block indices, repost, states and notifications', async () => {
    const { a, b, local, remote, block, blocks } = pair();
    const slice = (buf: Buffer) =>
      DescList.from(Array.from({ length: blocks }, (_, i) => buf.subarray(i * block, (i + 1) * block)));
    const l = a.prepXferDlist('NIXL_INIT_AGENT', slice(local));
    const r = a.prepXferDlist('prefill', slice(remote));
    // local block i <- remote block (blocks-1-i)
    const li = Uint32Array.from({ length: blocks }, (_, i) => i);
    const ri = Uint32Array.from({ length: blocks }, (_, i) => blocks - 1 - i);
    const h = a.makePreppedXfer('READ', l, li, r, ri, 'req-1:0');
    expect(() => a.checkXferState(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_POSTED' }));
    // 32 KiB: posted inline (DONE at once) unless the engine's thread has work queued.
    expect(['PROC', 'DONE']).toContain(a.transfer(h));
    await a.wait(h);
    expect(a.checkXferState(h)).toBe('DONE');
    for (let i = 0; i < blocks; i++) {
      expect(
        local
          .subarray(i * block, (i + 1) * block)
          .equals(remote.subarray((blocks - 1 - i) * block, (blocks - i) * block)),
      ).toBe(true);
    }
    const n = await b.waitForNotif({ agent: 'decode' }, { timeoutMs: 5000 });
    expect(n.msg.toString()).toBe('req-1:0');
    // repost with a new message
    local.fill(0);
    expect(['PROC', 'DONE']).toContain(a.transfer(h, 'req-1:1'));
    await a.wait(h);
    expect(local.subarray(0, block).equals(remote.subarray((blocks - 1) * block))).toBe(true);
    await b.waitForNotif({ msg: 'req-1:1' }, { timeoutMs: 5000 });
    a.releaseXferHandle(h);
    a.releaseDlistHandle(l);
    a.releaseDlistHandle(r);
  });

  it('sendNotif / getNewNotifs group messages by sender in order', async () => {
    const { a, b } = pair();
    for (let i = 0; i < 5; i++) a.sendNotif('prefill', `m${i}`);
    b.sendNotif('decode', Buffer.from([1, 2, 3]));
    await b.waitForNotif({ msg: 'm4' }, { timeoutMs: 5000 });
    const got = b.getNewNotifs();
    expect(got.get('decode')?.map(String)).toEqual(['m0', 'm1', 'm2', 'm3']);
    const back = await a.waitForNotif({}, { timeoutMs: 5000 });
    expect([...back.msg]).toEqual([1, 2, 3]);
    expect(() => a.sendNotif('nobody', 'x')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
  });

  it('telemetry needs captureTelemetry, as in NIXL', async () => {
    const a = agent('t1', { captureTelemetry: true });
    const b = agent('t2');
    const src = allocate(65536);
    const dst = Buffer.alloc(65536);
    b.registerMemory(src);
    a.registerMemory(dst);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer(
      'READ',
      [dst.subarray(0, 32768), dst.subarray(32768)],
      [src.subarray(0, 32768), src.subarray(32768)],
      't2',
    );
    expect(() => a.getXferTelemetry(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NO_TELEMETRY' }));
    a.transfer(h);
    await a.wait(h);
    const t = a.getXferTelemetry(h);
    expect(t.totalBytes).toBe(65536);
    expect(t.descCount).toBe(2);
    expect(t.startTimeUs).toBeGreaterThan(Date.now() * 1000 - 60e6);
    const c = pair();
    const h2 = c.a.initializeXfer('READ', c.local, c.remote, 'prefill');
    c.a.transfer(h2);
    await c.a.wait(h2);
    expect(() => c.a.getXferTelemetry(h2)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NO_TELEMETRY' }));
  });

  it('wait honours timeoutMs and AbortSignal on notifications', async () => {
    const { a } = pair();
    await expect(a.waitForNotif({ agent: 'prefill' }, { timeoutMs: 20 })).rejects.toMatchObject({
      code: 'NIXL_ERR_TIMEOUT',
    });
    const ac = new AbortController();
    const p = a.waitForNotif({}, { signal: ac.signal });
    ac.abort(new Error('stop'));
    await expect(p).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
  });

  it('raw {addr, len} descriptors work like buffers', async () => {
    const { a, local, remote } = pair();
    const { binding } = await import('../../lib/native');
    const raw = { addr: binding.addressOf(remote), len: remote.length };
    await a.read(local, [raw], 'prefill');
    expect(local.equals(remote)).toBe(true);
  });

  it('a repost while in progress is NIXL_ERR_REPOST_ACTIVE', async () => {
    const a = agent('rp-a', { testDelayUs: 200_000 });
    const b = agent('rp-b');
    const src = allocate(1 << 20);
    const dst = Buffer.alloc(1 << 20);
    b.registerMemory(src);
    a.registerMemory(dst);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer('READ', dst, src, 'rp-b');
    a.transfer(h);
    // the worker holds the transfer for 200 ms, so it is surely in flight
    expect(() => a.transfer(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_REPOST_ACTIVE' }));
    await a.wait(h);
  });

  it('a big transfer does not block the event loop', async () => {
    const a = agent('big-a');
    const b = agent('big-b');
    const size = 256 << 20;
    const src = allocate(size);
    const dst = allocate(size);
    b.registerMemory(src);
    a.registerMemory(dst);
    a.addRemoteAgent(b.getAgentMetadata());
    let ticks = 0;
    const iv = setInterval(() => ticks++, 1);
    const h = a.initializeXfer('READ', dst, src, 'big-b');
    a.transfer(h);
    const ticksAtPost = ticks;
    await a.wait(h);
    clearInterval(iv);
    expect(ticksAtPost).toBe(0); // post returned at once
    expect(ticks).toBeGreaterThan(0); // timers ran while the copy went on
  });
});
