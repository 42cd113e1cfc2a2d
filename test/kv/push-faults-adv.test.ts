// Push mode under an adversary: registrations that fail half-way, notifications
// repeated by one rank, state that must not grow without bound, and replays.
import { afterEach, describe, expect, it } from 'vitest';
import { KvPushReceiver, KvPushSender, NixlAgent, PushError, allocate, servePrefill } from '../../lib';
import { type PushRegistration, encodePushReg } from '../../lib/kv/push/reg';
import { ENGINE, BLOCK, BLOCKS, PUSH_HASH, PushPair, REGIONS, quiet, rankLayout } from './push-helpers';

const pairs: PushPair[] = [];
const start = async (o?: Parameters<typeof PushPair.start>[0]) => {
  const t = await PushPair.start(o);
  pairs.push(t);
  return t;
};
afterEach(async () => {
  for (const t of pairs.splice(0)) await t.close();
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('push receive failing while registering', () => {
  it('a registration that cannot be sent fails the receive once: no unhandled rejection at the deadline', async () => {
    const t = await start({ receiver: { quarantineMs: 50 } });
    const rejections: unknown[] = [];
    const onRej = (e: unknown) => rejections.push(e);
    process.on('unhandledRejection', onRej);
    try {
      const warm = t.receiver.receive(t.params(), { requestId: 'warm', localBlockIds: [3] });
      await t.sender.offer('warm', [6]);
      await warm;
      // The prefill goes away; the receiver still holds its engine, so the registration's send fails.
      await t.sender.close();
      t.pAgent.close();
      const err = await t.receiver
        .receive(t.params(), { requestId: 'gone', localBlockIds: [1], timeoutMs: 200 })
        .catch((e: unknown) => e);
      expect(err).toBeInstanceOf(PushError);
      // Loopback refuses a notification to a closed agent at once; NIXL (UCX) takes it and drops it, so the
      // receive can only fail by its deadline.
      expect(err).toMatchObject({ kind: ENGINE === 'nixl' ? 'timeout' : 'peer-gone' });
      await sleep(400);
      expect(rejections).toEqual([]);
      expect(t.receiver.resources().receiving).toBe(0);
    } finally {
      process.off('unhandledRejection', onRej);
    }
  });
});

describe('push receive after the prefill restarted', () => {
  it('a registration that could not be delivered makes the next receive handshake afresh', async () => {
    const t = await start({ receiver: { quarantineMs: 50 } });
    const warm = t.receiver.receive(t.params(), { requestId: 'warm', localBlockIds: [3] });
    await t.sender.offer('warm', [6]);
    await warm;
    // The prefill restarts on the same side-channel port, under a new agent.
    const port = t.pServer.basePort;
    await t.sender.close();
    await t.pServer.close();
    t.pAgent.close();
    t.pAgent = new NixlAgent('push-p-new', { engine: ENGINE });
    t.pAgent.registerMemory(t.pmem);
    const layout = rankLayout('P', t.pmem);
    t.pServer = await servePrefill({ ranks: [{ agent: t.pAgent, layout }], compatibilityHash: PUSH_HASH, port });
    t.sender = new KvPushSender({ agent: t.pAgent, layout, expectedHash: PUSH_HASH, leaseMs: 5000, logger: quiet });
    const first = await t.receiver
      .receive(t.params(), { requestId: 'first', localBlockIds: [1], timeoutMs: 300 })
      .catch((e: unknown) => e);
    // Either it reached the new prefill at once, or it failed as peer-gone (loopback: the old agent refuses
    // the notification) or by its deadline (NIXL takes a notification to a gone agent); the next one must work.
    if (first instanceof PushError) expect(first.kind).toBe(ENGINE === 'nixl' ? 'timeout' : 'peer-gone');
    const got = t.receiver.receive(t.params(), { requestId: 'next', localBlockIds: [2], timeoutMs: 2000 });
    const sent = await t.sender.offer('next', [9]);
    expect(sent.reason).toBe('written');
    expect(await got).toMatchObject({ notifications: 1, writers: ['push-p-new'] });
    expect(t.same([9], [2])).toBe(true);
  });
});

describe('counting WRITE notifications', () => {
  it('prefill TP 2, decode TP 1: two notifications from one prefill rank do not prove the other rank wrote', async () => {
    const t = await start();
    const ranks = [0, 1].map((r) => {
      const agent = new NixlAgent(`push-p2-${r}`, { engine: ENGINE });
      const mem = allocate(REGIONS * BLOCKS * BLOCK);
      agent.registerMemory(mem);
      return { agent, layout: rankLayout('P2', mem, 2, r) };
    });
    const server = await servePrefill({ ranks, compatibilityHash: PUSH_HASH, port: 0 });
    try {
      const params = t.params({ remote_engine_id: 'P2', remote_port: server.basePort, tp_size: 2 });
      const got = t.receiver
        .receive(params, { requestId: 'two', localBlockIds: [1], timeoutMs: 600 })
        .catch((e: unknown) => e);
      const p0 = ranks[0].agent;
      p0.addRemoteAgent(t.dAgent.getAgentMetadata());
      // The registration went to both ranks; only rank 0 answers, twice.
      const regs = await Promise.all(
        ranks.map((r) =>
          r.agent.waitForNotif((n) => n.msg.subarray(0, 9).toString() === 'PUSH_REG:', { timeoutMs: 2000 }),
        ),
      );
      expect(regs).toHaveLength(2);
      p0.sendNotif('push-d', 'two:2');
      p0.sendNotif('push-d', 'two:2');
      const r = await got;
      expect(r).toBeInstanceOf(PushError);
      expect(r).toMatchObject({ kind: 'mismatch', code: 'NIXL_ERR_MISMATCH' });
      expect((r as Error).message).toMatch(/second WRITE notification from prefill agent 'push-p2-0'/);
      // One notification from each rank completes a receive.
      ranks[1].agent.addRemoteAgent(t.dAgent.getAgentMetadata());
      const ok = t.receiver.receive(params, { requestId: 'two-ok', localBlockIds: [2], timeoutMs: 2000 });
      await Promise.all(ranks.map((x) => x.agent.waitForNotif((n) => n.msg.includes('two-ok'), { timeoutMs: 2000 })));
      for (const x of ranks) x.agent.sendNotif('push-d', 'two-ok:2');
      expect(await ok).toMatchObject({ notifications: 2 });
    } finally {
      await server.close();
      for (const r of ranks) r.agent.close();
    }
  });
});

describe('what a receiver keeps', () => {
  it('ids given up on are forgotten once no WRITE for them can come (they did not leave without a late WRITE)', async () => {
    const t = await start({ receiver: { kvLeaseMs: 30, quarantineMs: 20 } });
    const warm = t.receiver.receive(t.params(), { requestId: 'warm', localBlockIds: [3] });
    await t.sender.offer('warm', [6]);
    await warm;
    for (const [i, id] of ['g1', 'g2', 'g3'].entries())
      await t.receiver
        .receive(t.params(), { requestId: id, localBlockIds: [10 + i], timeoutMs: 60 })
        .catch((e: unknown) => expect(e).toMatchObject({ kind: 'timeout' }));
    expect(t.receiver.resources().gaveUp).toBe(3);
    // quarantine (20 ms) + 10 leases (300 ms): none of them is kept past that.
    await sleep(450);
    const got = t.receiver.receive(t.params(), { requestId: 'after', localBlockIds: [1] });
    await t.sender.offer('after', [4]);
    await got;
    expect(t.receiver.resources()).toMatchObject({ gaveUp: 0, receiving: 0, quarantined: 0 });
  });
});

describe('signed registrations replayed', () => {
  it('a signed registration sent again after the prefill forgot it is refused: no WRITE into the decode', async () => {
    const t = await start({ sender: { secret: 'k', registrationTtlMs: 200 } });
    const bytes = encodePushReg(
      {
        requestId: 'rp',
        decodeEngineId: 'D',
        decodeHost: '127.0.0.1',
        decodePort: t.dServer.basePort,
        decodeTpSize: 1,
        localBlockIds: [[1]],
        remoteEngineId: 'P',
        remoteHost: '127.0.0.1',
        remotePort: t.pServer.basePort,
        remoteTpSize: 1,
        remotePpSize: 1,
        sentAtMs: Date.now(),
      } as PushRegistration,
      'k',
    );
    t.dAgent.addRemoteAgent(t.pAgent.getAgentMetadata());
    t.dAgent.sendNotif('push-p', bytes);
    expect(await t.sender.offer('rp', [5])).toMatchObject({ reason: 'written' });
    expect(t.same([5], [1])).toBe(true);
    t.dmem.fill(0);
    await sleep(400);
    // The same bytes again (captured on the wire), and a new request of that id on the prefill.
    const refused = t.sender.stats.refused;
    t.dAgent.sendNotif('push-p', bytes);
    const off = t.sender.offer('rp', [6]);
    await sleep(200);
    expect(t.sender.stats.refused).toBe(refused + 1);
    t.sender.abort('rp');
    expect((await off).reason).toBe('aborted');
    expect(t.untouched()).toBe(true);
  });
});

describe('receiver options and receive deadlines', () => {
  it('a decode address no registration could carry, and a deadline a timer cannot hold, are refused up front', async () => {
    const t = await start();
    const mk = (o: Record<string, unknown>) => () =>
      new KvPushReceiver({
        agent: t.dAgent,
        layout: rankLayout('D', t.dmem),
        decodeHost: '127.0.0.1',
        decodePort: 1,
        ...o,
      });
    expect(mk({ decodePort: 0 })).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
    expect(mk({ decodePort: 70000 })).toThrow(/decode/);
    expect(mk({ decodeHost: '' })).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
    expect(mk({ decodeHost: 'h'.repeat(300) })).toThrow(/decode/);
    for (const timeoutMs of [2 ** 31, Number.NaN, -1])
      expect(
        await t.receiver
          .receive(t.params(), { requestId: `d${timeoutMs}`, localBlockIds: [1], timeoutMs })
          .catch((e: unknown) => e),
      ).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_INVALID_PARAM', quarantinedUntilMs: undefined });
    expect(t.receiver.resources()).toMatchObject({ quarantined: 0, gaveUp: 0 });
  });
});
