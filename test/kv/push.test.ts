// Push mode on the loopback engine, both roles in one process: a decode
// registers its blocks (KvPushReceiver), a prefill pairs the registration
// with a finished request and WRITEs (KvPushSender). Both orders, prefix
// trims, pairing, heartbeats, and that the bytes that land are the prefill's.
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { KvPushSender, PushError } from '../../lib';
import { BLOCK, PushPair, REGIONS, blockOf, quiet, rankLayout, until } from './push-helpers';

let t: PushPair;
beforeEach(async () => {
  t = await PushPair.start();
});
afterEach(() => t.close());

describe('push on loopback', () => {
  it('registration first (case A): the prefill WRITEs our blocks and the decode proves every WRITE came', async () => {
    const got = t.receiver.receive(t.params(), { requestId: 'cmpl-a-0a1b2c3d', localBlockIds: [5, 6, 7] });
    // The registration is a notification: over NIXL it may take a UCX connection set-up to arrive.
    await until(() => t.sender.pending.registrations === 1);
    const sent = await t.sender.offer('cmpl-a-0a1b2c3d', [1, 2, 3]);
    const r = await got;
    expect(sent).toMatchObject({ reason: 'written', decodeRequestId: 'cmpl-a-0a1b2c3d', writes: 1 });
    expect(sent.bytes).toBe(3 * REGIONS * BLOCK);
    expect(r).toMatchObject({ requestId: 'cmpl-a-0a1b2c3d', notifications: 1, writers: ['push-p'] });
    expect(t.same([1, 2, 3], [5, 6, 7])).toBe(true);
    expect(blockOf(t.dmem, 0, 4).every((x) => x === 0)).toBe(true);
    expect(t.receiver.resources()).toMatchObject({ receiving: 0, quarantined: 0 });
    expect(t.sender.resources()).toMatchObject({ offers: 0, registrations: 0, xferHandles: 0 });
  });

  it('prefill first (case B), paired by base id across engine suffixes', async () => {
    const sent = t.sender.offer('cmpl-b-11111111', [8, 9]);
    const r = await t.receiver.receive(t.params(), { requestId: 'cmpl-b-22222222', localBlockIds: [[0, 1]] });
    expect(r.notifications).toBe(1);
    expect(await sent).toMatchObject({ reason: 'written', decodeRequestId: 'cmpl-b-22222222' });
    expect(t.same([8, 9], [0, 1])).toBe(true);
  });

  it('a decode prefix hit registers fewer blocks: the prefill end-trims its own', async () => {
    const sent = t.sender.offer('trim', [1, 2, 3, 4]);
    await t.receiver.receive(t.params(), { requestId: 'trim', localBlockIds: [20, 21] });
    expect((await sent).bytes).toBe(2 * REGIONS * BLOCK);
    expect(t.same([3, 4], [20, 21])).toBe(true);
  });

  it('two live requests with one base id pair with neither: never cross-written', async () => {
    const a = t.sender.offer('cmpl-x-aaaaaaaa', [1]);
    const b = t.sender.offer('cmpl-x-bbbbbbbb', [2]);
    const err = await t.receiver
      .receive(t.params(), { requestId: 'cmpl-x-cccccccc', localBlockIds: [3], timeoutMs: 300 })
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(PushError);
    expect(err).toMatchObject({ kind: 'timeout', code: 'NIXL_ERR_TIMEOUT' });
    expect(blockOf(t.dmem, 0, 3).every((x) => x === 0)).toBe(true);
    expect(t.sender.abort('cmpl-x-aaaaaaaa') && t.sender.abort('cmpl-x-bbbbbbbb')).toBe(true);
    expect((await a).reason).toBe('aborted');
    expect((await b).reason).toBe('aborted');
  });

  it('heartbeats naming an offered request extend its lease (vLLM: max(old, now + 2/3 lease)); unmatched ids do nothing', async () => {
    // The heartbeat goes at 1/2 of the lease: whenever it is processed before the lease ends (half a lease of
    // slack, not a fixed wait), now + 2/3 lease lies past the first end, so the end must move to at least that.
    const lease = 1200;
    await t.sender.close();
    t.sender = new KvPushSender({ agent: t.pAgent, layout: rankLayout('P', t.pmem), leaseMs: lease, logger: quiet });
    t.dAgent.addRemoteAgent(t.pAgent.getAgentMetadata());
    const t0 = performance.now();
    const sent = t.sender.offer('hb-req', [1]);
    const end0 = t.sender.leaseEnd('hb-req')!;
    await new Promise((r) => setTimeout(r, lease / 2));
    const hbAt = performance.now();
    t.dAgent.sendNotif('push-p', 'HB:other,hb-req');
    await expect.poll(() => t.sender.stats.heartbeats, { interval: 5, timeout: lease }).toBe(1);
    const end1 = t.sender.leaseEnd('hb-req')!;
    expect(end1).toBeGreaterThan(end0);
    expect(end1).toBeGreaterThanOrEqual(hbAt + Math.floor((lease * 2) / 3));
    expect(await sent).toMatchObject({ reason: 'expired', writes: 0 });
    // Held until the extended end, not the first one.
    expect(performance.now() - t0).toBeGreaterThanOrEqual(end1 - t0 - 1);
  });
});
