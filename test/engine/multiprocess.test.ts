// Two real processes: metadata over the IPC pipe, blocks pulled both ways,
// every byte checked. Memory from allocate() goes through the shared mapping;
// plain Buffers through process_vm_readv/writev.
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, allocate } from '../../lib';
import { Peer, checkPattern, pattern } from '../helpers';

const SIZE = 4 << 20;
const BLOCK = 256 << 10;
let peer: Peer | undefined;
let agent: NixlAgent | undefined;

afterEach(async () => {
  agent?.close();
  agent = undefined;
  if (peer && peer.proc.exitCode === null) peer.kill();
  peer = undefined;
});

async function setup(shared: boolean, testDelayUs?: number) {
  agent = new NixlAgent('parent', { engine: 'loopback', testDelayUs });
  const mem = shared ? allocate(SIZE) : Buffer.alloc(SIZE);
  pattern(mem, 1);
  agent.registerMemory(mem);
  peer = new Peer('peer.js');
  const init = await peer.initAgent({ name: 'child', size: SIZE, shared, seed: 2 });
  expect(agent.addRemoteAgent(Buffer.from(init.md))).toBe('child');
  await peer.request({ cmd: 'load', md: agent.getAgentMetadata() });
  return { mem, childAddr: init.addr, myAddr: DescList.from(mem).addr(0) };
}

describe.each([
  ['shared mapping (allocate)', true],
  ['process_vm (plain Buffer)', false],
])('two processes, %s', (_label, shared) => {
  it('pulls blocks both ways and writes both ways, every byte verified', async () => {
    const { mem, childAddr, myAddr } = await setup(shared);
    // parent READs every other block of the child's memory
    const n = SIZE / BLOCK;
    const blocks = Array.from({ length: n / 2 }, (_, i) => 2 * i);
    const local = DescList.from(blocks.map((b) => mem.subarray(b * BLOCK, (b + 1) * BLOCK)));
    const remote = DescList.from(blocks.map((b) => ({ addr: childAddr + BigInt(b * BLOCK), len: BLOCK })));
    await agent!.read(local, remote, 'child', { notifMsg: 'pulled' });
    for (let b = 0; b < n; b++) {
      const slice = mem.subarray(b * BLOCK, (b + 1) * BLOCK);
      expect(checkPattern(slice, b % 2 === 0 ? 2 : 1, b * BLOCK)).toBe(true);
    }
    expect(await peer!.request({ cmd: 'waitNotif', from: 'parent', timeoutMs: 5000 })).toEqual({
      agent: 'parent',
      msg: 'pulled',
    });

    // child READs the parent's second half, then WRITEs its first quarter into the parent
    pattern(mem, 5);
    await peer!.request({
      cmd: 'xfer',
      op: 'READ',
      remote: 'parent',
      remoteAddr: myAddr,
      offset: SIZE / 2,
      len: SIZE / 2,
      notif: 'r',
    });
    await agent!.waitForNotif({ agent: 'child', msg: 'r' }, { timeoutMs: 5000 });
    const dump = await peer!.request<{ data: Uint8Array }>({ cmd: 'dump' });
    const child = Buffer.from(dump.data);
    expect(checkPattern(child.subarray(SIZE / 2), 5, SIZE / 2)).toBe(true);
    expect(checkPattern(child.subarray(0, SIZE / 2), 2)).toBe(true);

    await peer!.request({ cmd: 'xfer', op: 'WRITE', remote: 'parent', remoteAddr: myAddr, offset: 0, len: SIZE / 4 });
    expect(checkPattern(mem.subarray(0, SIZE / 4), 2)).toBe(true);
    expect(checkPattern(mem.subarray(SIZE / 4), 5, SIZE / 4)).toBe(true);

    // parent WRITEs its whole memory into the child
    await agent!.write(mem, [{ addr: childAddr, len: SIZE }], 'child');
    const after = Buffer.from((await peer!.request<{ data: Uint8Array }>({ cmd: 'dump' })).data);
    expect(after.equals(mem)).toBe(true);
  });

  it('descriptors whose addr + len wraps past 2^64 are refused before any byte moves', async () => {
    const { mem, childAddr } = await setup(shared);
    const before = Buffer.from(mem);
    const wrap = { addr: childAddr + 16n, len: (1n << 64n) - 8n };
    expect(() => agent!.prepXferDlist('child', [wrap])).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
    await expect(
      agent!.read([{ addr: DescList.from(mem).addr(0), len: (1n << 64n) - 8n }], [wrap], 'child'),
    ).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
    });
    // One byte past the end of the peer's region, computed without wrapping: not registered memory.
    expect(() => agent!.prepXferDlist('child', [{ addr: childAddr + 1n, len: SIZE }])).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }),
    );
    expect(mem.equals(before)).toBe(true);
  });

  it('a dead peer fails the transfer with NIXL_ERR_REMOTE_DISCONNECT, and this process lives on', async () => {
    const { mem, childAddr } = await setup(shared);
    peer!.kill();
    await peer!.exit();
    const before = Buffer.from(mem);
    await expect(agent!.read(mem.subarray(0, BLOCK), [{ addr: childAddr, len: BLOCK }], 'child')).rejects.toMatchObject(
      { code: 'NIXL_ERR_REMOTE_DISCONNECT' },
    );
    expect(mem.equals(before)).toBe(true);
    expect(() => agent!.sendNotif('child', 'x')).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_REMOTE_DISCONNECT' }),
    );
  });
});

it('metadata of a process that is gone is refused', async () => {
  peer = new Peer('peer.js');
  const init = await peer.request<{ md: Uint8Array }>({
    cmd: 'init',
    name: 'ghost',
    size: 4096,
    shared: true,
    seed: 0,
  });
  peer.kill();
  await peer.exit();
  agent = new NixlAgent('parent', { engine: 'loopback' });
  expect(() => agent!.addRemoteAgent(Buffer.from(init.md))).toThrow(
    expect.objectContaining({ code: 'NIXL_ERR_REMOTE_DISCONNECT' }),
  );
});

describe.each([
  ['shared mapping (allocate)', true],
  ['process_vm (plain Buffer)', false],
])('a peer process deregisters or closes, %s', (_label, shared) => {
  it('a read after the peer deregistered and reused its memory is NIXL_ERR_NOT_FOUND, not the new bytes', async () => {
    const { mem, childAddr } = await setup(shared);
    await peer!.request({ cmd: 'dereg', seed: 9 });
    const before = Buffer.from(mem);
    await expect(agent!.read(mem.subarray(0, BLOCK), [{ addr: childAddr, len: BLOCK }], 'child')).rejects.toMatchObject(
      { code: 'NIXL_ERR_NOT_FOUND' },
    );
    expect(mem.equals(before)).toBe(true);
  });

  it('a deregistration while the transfer waits in the queue fails it', async () => {
    // The transfer waits 400 ms in the worker; the peer deregisters meanwhile.
    const { mem, childAddr } = await setup(shared, 400_000);
    const p = agent!.read(mem, [{ addr: childAddr, len: SIZE }], 'child');
    await peer!.request({ cmd: 'dereg', seed: 9 });
    await expect(p).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_FOUND' });
    expect(checkPattern(mem.subarray(0, 4096), 9)).toBe(false);
  });

  it('a read after the peer closed its agent (process alive) is NIXL_ERR_REMOTE_DISCONNECT', async () => {
    const { mem, childAddr } = await setup(shared);
    await peer!.request({ cmd: 'closeAgent' });
    await expect(agent!.read(mem.subarray(0, BLOCK), [{ addr: childAddr, len: BLOCK }], 'child')).rejects.toMatchObject(
      { code: 'NIXL_ERR_REMOTE_DISCONNECT' },
    );
  });
});

it('a stopped peer does not hold up transfers from healthy peers; its notifications arrive in order once it runs', async () => {
  agent = new NixlAgent('parent', { engine: 'loopback' });
  const mem = allocate(SIZE);
  agent.registerMemory(mem);
  const healthy = new Peer('peer.js');
  const stalled = new Peer('peer.js');
  try {
    const h = await healthy.initAgent({ name: 'healthy', size: SIZE, shared: true, seed: 3 });
    const s = await stalled.initAgent({ name: 'stalled', size: SIZE, shared: true, seed: 4 });
    agent.addRemoteAgent(Buffer.from(h.md));
    agent.addRemoteAgent(Buffer.from(s.md));
    process.kill(stalled.proc.pid!, 'SIGSTOP');
    // Fill the stopped peer's socket queue; the rest queue up in order.
    const big = Buffer.alloc(60_000, 1);
    for (let i = 0; i < 64; i++) agent.sendNotif('stalled', Buffer.concat([Buffer.from(`n${i}:`), big]));
    const stalledRead = agent.read(mem.subarray(0, BLOCK), [{ addr: s.addr, len: BLOCK }], 'stalled', {
      notifMsg: 'last',
    });
    const t0 = performance.now();
    for (let i = 0; i < 8; i++) {
      await agent.read(mem.subarray(BLOCK, 2 * BLOCK), [{ addr: h.addr, len: BLOCK }], 'healthy', {
        notifMsg: `h${i}`,
      });
    }
    const healthyMs = performance.now() - t0;
    expect(healthyMs).toBeLessThan(2000);
    expect(checkPattern(mem.subarray(BLOCK, 2 * BLOCK), 3, 0)).toBe(true);
    process.kill(stalled.proc.pid!, 'SIGCONT');
    await stalledRead; // its notification went out once the peer drained its queue
    const got: string[] = [];
    for (let t = 0; t < 100 && !got.includes('last'); t++) {
      got.push(
        ...(await stalled.request<{ msgs: string[] }>({ cmd: 'notifs', from: 'parent' })).msgs.map(
          (m) => m.split(':')[0],
        ),
      );
      await new Promise((r) => setTimeout(r, 20));
    }
    expect(got).toEqual([...Array.from({ length: 64 }, (_, i) => `n${i}`), 'last']);
    const hs = (await healthy.request<{ msgs: string[] }>({ cmd: 'notifs', from: 'parent' })).msgs;
    expect(hs).toEqual(Array.from({ length: 8 }, (_, i) => `h${i}`));
  } finally {
    try {
      process.kill(stalled.proc.pid!, 'SIGCONT');
    } catch {
      /* gone */
    }
    healthy.kill();
    stalled.kill();
  }
});
