// Bad input: every case is a NixlError with a code, nothing is touched, and
// the process goes on.
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, NixlError, allocate } from '../../lib';
import { binding } from '../../lib/native';

const open: NixlAgent[] = [];
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

function setup() {
  const a = new NixlAgent('va', { engine: 'loopback' });
  const b = new NixlAgent('vb', { engine: 'loopback' });
  open.push(a, b);
  const local = Buffer.alloc(8192, 1);
  const remote = allocate(8192);
  remote.fill(2);
  const lreg = a.registerMemory(local);
  const rreg = b.registerMemory(remote);
  a.addRemoteAgent(b.getAgentMetadata());
  const raddr = binding.addressOf(remote);
  const laddr = binding.addressOf(local);
  return { a, b, local, remote, lreg, rreg, raddr, laddr };
}

function code(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(NixlError);
    expect(typeof (e as NixlError).status).toBe('number');
    return (e as NixlError).code;
  }
  throw new Error('did not throw');
}

describe('descriptor validation', () => {
  it('out-of-bounds and unregistered descriptors are NIXL_ERR_NOT_FOUND', () => {
    const { a, local, raddr, laddr } = setup();
    // remote: one byte past the registered region
    expect(code(() => a.initializeXfer('READ', local, [{ addr: raddr, len: 8193 }], 'vb'))).toBe('NIXL_ERR_NOT_FOUND');
    expect(code(() => a.initializeXfer('READ', local.subarray(0, 16), [{ addr: raddr - 16n, len: 16 }], 'vb'))).toBe(
      'NIXL_ERR_NOT_FOUND',
    );
    // local: memory that was never registered
    expect(code(() => a.initializeXfer('READ', Buffer.alloc(16), [{ addr: raddr, len: 16 }], 'vb'))).toBe(
      'NIXL_ERR_NOT_FOUND',
    );
    expect(code(() => a.prepXferDlist('', [{ addr: laddr + 8000n, len: 400 }]))).toBe('NIXL_ERR_NOT_FOUND');
    // wrong device id
    expect(code(() => a.prepXferDlist('vb', [{ addr: raddr, len: 16, devId: 1 }]))).toBe('NIXL_ERR_NOT_FOUND');
    expect(local.every((v) => v === 1)).toBe(true);
  });

  it('unknown and removed remote agents are NIXL_ERR_NOT_FOUND, also for handles made before', async () => {
    const { a, local, raddr } = setup();
    expect(code(() => a.prepXferDlist('nobody', [{ addr: raddr, len: 16 }]))).toBe('NIXL_ERR_NOT_FOUND');
    const h = a.initializeXfer('READ', local, [{ addr: raddr, len: 8192 }], 'vb');
    a.removeRemoteAgent('vb');
    expect(code(() => a.transfer(h))).toBe('NIXL_ERR_NOT_FOUND');
    expect(code(() => a.removeRemoteAgent('vb'))).toBe('NIXL_ERR_NOT_FOUND');
    expect(local.every((v) => v === 1)).toBe(true);
  });

  it('mismatched lengths, counts and indices are NIXL_ERR_INVALID_PARAM', () => {
    const { a, local, raddr } = setup();
    expect(code(() => a.initializeXfer('READ', local.subarray(0, 100), [{ addr: raddr, len: 101 }], 'vb'))).toBe(
      'NIXL_ERR_INVALID_PARAM',
    );
    expect(
      code(() =>
        a.initializeXfer('READ', [local.subarray(0, 10), local.subarray(10, 20)], [{ addr: raddr, len: 10 }], 'vb'),
      ),
    ).toBe('NIXL_ERR_INVALID_PARAM');
    const l = a.prepXferDlist('', [local.subarray(0, 4096), local.subarray(4096)]);
    const r = a.prepXferDlist('vb', [
      { addr: raddr, len: 4096 },
      { addr: raddr + 4096n, len: 4096 },
    ]);
    expect(code(() => a.makePreppedXfer('READ', l, [0, 2], r, [0, 1]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.makePreppedXfer('READ', l, [0], r, [0, 1]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.makePreppedXfer('READ', r, [0], l, [0]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.makePreppedXfer('COPY' as 'READ', l, [0], r, [0]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.makePreppedXfer('READ', l, [], r, []))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => new DescList(new BigUint64Array(4)))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory([], {}))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory(Buffer.alloc(0)))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory(local, { memType: 'HBM' as 'DRAM' }))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory([{ addr: 1n << 40n, len: 4096 }]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory([{ addr: 0n, len: 4096 }]))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.registerMemory([{ addr: 0x1234n, len: 8, devId: 0 }], { memType: 'VRAM' }))).toBe(
      'NIXL_ERR_NOT_SUPPORTED',
    );
    expect(code(() => a.sendNotif('vb', Buffer.alloc(65 * 1024)))).toBe('NIXL_ERR_INVALID_PARAM');
  });

  it('double release and stale handles are NIXL_ERR_NOT_FOUND', async () => {
    const { a, local, raddr, lreg } = setup();
    const h = a.initializeXfer('READ', local, [{ addr: raddr, len: 8192 }], 'vb');
    a.transfer(h);
    await a.wait(h);
    a.releaseXferHandle(h);
    expect(code(() => a.releaseXferHandle(h))).toBe('NIXL_ERR_NOT_FOUND');
    expect(code(() => a.checkXferState(h))).toBe('NIXL_ERR_NOT_FOUND');
    expect(code(() => a.transfer(h))).toBe('NIXL_ERR_NOT_FOUND');
    const d = a.prepXferDlist('', local);
    a.releaseDlistHandle(d);
    expect(code(() => a.releaseDlistHandle(d))).toBe('NIXL_ERR_NOT_FOUND');
    a.deregisterMemory(lreg);
    expect(code(() => a.deregisterMemory(lreg))).toBe('NIXL_ERR_NOT_FOUND');
  });

  it('deregistered memory: handles made before fail at post, nothing touched', () => {
    const { a, b, local, raddr, lreg, rreg } = setup();
    const h = a.initializeXfer('READ', local, [{ addr: raddr, len: 8192 }], 'vb');
    a.deregisterMemory(lreg);
    expect(code(() => a.transfer(h))).toBe('NIXL_ERR_NOT_FOUND');
    a.registerMemory(local);
    const h2 = a.initializeXfer('READ', local, [{ addr: raddr, len: 8192 }], 'vb');
    b.deregisterMemory(rreg); // same process: the peer's live registrations are checked
    expect(code(() => a.transfer(h2))).toBe('NIXL_ERR_NOT_FOUND');
    expect(local.every((v) => v === 1)).toBe(true);
  });

  it('deregister during a transfer is refused, the transfer completes intact', async () => {
    const a = new NixlAgent('da', { engine: 'loopback', testDelayUs: 200_000 }); // held in flight 200 ms
    const b = new NixlAgent('db', { engine: 'loopback' });
    open.push(a, b);
    const src = allocate(4 << 20);
    src.fill(9);
    const dst = Buffer.alloc(4 << 20);
    const rreg = b.registerMemory(src);
    const lreg = a.registerMemory(dst);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer('READ', dst, src, 'db');
    a.transfer(h);
    expect(code(() => a.deregisterMemory(lreg))).toBe('NIXL_ERR_NOT_ALLOWED');
    expect(code(() => b.deregisterMemory(rreg))).toBe('NIXL_ERR_NOT_ALLOWED');
    await a.wait(h);
    expect(dst.every((v) => v === 9)).toBe(true);
    a.deregisterMemory(lreg); // free again once done
    b.deregisterMemory(rreg);
  });

  it('releasing an in-flight handle rejects its waiters with NIXL_ERR_CANCELED', async () => {
    const a = new NixlAgent('ra', { engine: 'loopback', testDelayUs: 100_000 });
    const b = new NixlAgent('rb', { engine: 'loopback' });
    open.push(a, b);
    const src = allocate(4 << 20);
    const dst = Buffer.alloc(4 << 20);
    b.registerMemory(src);
    const lreg = a.registerMemory(dst);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer('READ', dst, src, 'rb');
    a.transfer(h);
    const p = a.wait(h);
    a.releaseXferHandle(h);
    await expect(p).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
    // the copy still finishes on the worker, then the memory is free
    for (let i = 0; i < 200; i++) {
      try {
        a.deregisterMemory(lreg);
        return;
      } catch {
        await new Promise((r) => setTimeout(r, 10));
      }
    }
    throw new Error('memory stayed pinned after the released transfer');
  });

  it('use after close is NIXL_ERR_NOT_ALLOWED, pending waits are canceled', async () => {
    const { a, local, raddr } = setup();
    const p = a.waitForNotif({ agent: 'vb' });
    a.close();
    await expect(p).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
    expect(code(() => a.registerMemory(local))).toBe('NIXL_ERR_NOT_ALLOWED');
    expect(code(() => a.initializeXfer('READ', local, [{ addr: raddr, len: 16 }], 'vb'))).toBe('NIXL_ERR_NOT_ALLOWED');
    expect(code(() => a.getAgentMetadata())).toBe('NIXL_ERR_NOT_ALLOWED');
    a.close(); // twice is fine
  });

  it('a closed same-process peer is NIXL_ERR_REMOTE_DISCONNECT', () => {
    const { a, b, local, raddr } = setup();
    const h = a.initializeXfer('READ', local, [{ addr: raddr, len: 8192 }], 'vb');
    b.close();
    expect(code(() => a.transfer(h))).toBe('NIXL_ERR_REMOTE_DISCONNECT');
    expect(local.every((v) => v === 1)).toBe(true);
  });

  it('garbage, truncated and own metadata are refused', () => {
    const { a, b } = setup();
    const md = b.getAgentMetadata();
    expect(code(() => a.addRemoteAgent(Buffer.from('hello world')))).toBe('NIXL_ERR_INVALID_PARAM');
    for (const cut of [8, 12, 20, md.length - 1]) {
      expect(code(() => a.addRemoteAgent(md.subarray(0, cut)))).toBe('NIXL_ERR_INVALID_PARAM');
    }
    const bad = Buffer.from(md);
    bad.writeUInt32LE(0xffffffff, 13); // name length, after magic, version and flags
    expect(code(() => a.addRemoteAgent(bad))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.addRemoteAgent(a.getAgentMetadata()))).toBe('NIXL_ERR_NOT_ALLOWED');
    expect(code(() => a.addRemoteAgent(md))).toBe('NIXL_ERR_NOT_ALLOWED'); // already loaded, as NIXL
    a.removeRemoteAgent('vb');
    expect(a.addRemoteAgent(md)).toBe('vb');
    expect(code(() => a.addRemoteAgent('md' as unknown as Buffer))).toBe('NIXL_ERR_INVALID_PARAM');
  });

  it('garbage arguments to the native layer never crash', () => {
    const n = new binding.NativeAgent('g', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
    try {
      const bad = [undefined, null, 1.5, -1, 'x', {}, [], new Uint8Array(3), new BigUint64Array(2)];
      for (const v of bad) {
        for (const f of [
          () => n.registerMem(v as never, 0, [], []),
          () => n.deregisterMem(v as never),
          () => n.prepXferDlist(v as never, new BigUint64Array(0), 0),
          () => n.makeXferReq('READ', 1, v as never, 1, v as never),
          () => n.postXferReq(v as never),
          () => n.getXferStatus(v as never),
          () => n.releaseXferReq(v as never),
          () => n.loadRemoteMD(v as never),
          () => n.genNotif(v as never, v as never),
          () => n.registerMem(new BigUint64Array(3), v as never, [], []),
        ]) {
          expect(() => f()).toThrow(NixlError);
        }
      }
      expect(() => new binding.NativeAgent('g2', { engine: 'gpu' as 'nixl', backends: [] }, () => {})).toThrow(
        NixlError,
      );
      expect(() => binding.allocate(0)).toThrow(NixlError);
      expect(() => binding.allocate(-5)).toThrow(NixlError);
      expect(() => binding.addressOf({} as ArrayBuffer)).toThrow(NixlError);
    } finally {
      n.close();
    }
  });
});
