// Push mode under an adversary: registrations that fail half-way, notifications
// repeated by one rank, state that must not grow without bound, and replays.
import { afterEach, describe, expect, it } from 'vitest';
import { KvPushSender, NixlAgent, PushError, servePrefill } from '../../lib';
import { PUSH_HASH, PushPair, quiet, rankLayout } from './push-helpers';

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
      expect(err).toMatchObject({ kind: 'peer-gone' });
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
    t.pAgent = new NixlAgent('push-p-new', { engine: 'loopback' });
    t.pAgent.registerMemory(t.pmem);
    const layout = rankLayout('P', t.pmem);
    t.pServer = await servePrefill({ ranks: [{ agent: t.pAgent, layout }], compatibilityHash: PUSH_HASH, port });
    t.sender = new KvPushSender({ agent: t.pAgent, layout, expectedHash: PUSH_HASH, leaseMs: 5000, logger: quiet });
    const first = await t.receiver
      .receive(t.params(), { requestId: 'first', localBlockIds: [1], timeoutMs: 300 })
      .catch((e: unknown) => e);
    // Either it reached the new prefill at once, or it failed as peer-gone; the next one must work.
    if (first instanceof PushError) expect(first.kind).toBe('peer-gone');
    const got = t.receiver.receive(t.params(), { requestId: 'next', localBlockIds: [2], timeoutMs: 2000 });
    const sent = await t.sender.offer('next', [9]);
    expect(sent.reason).toBe('written');
    expect(await got).toMatchObject({ notifications: 1, writers: ['push-p-new'] });
    expect(t.same([9], [2])).toBe(true);
  });
});
