// Pairing on the prefill side: registrations keyed by (decode engine, request
// id, rank) so distinct decodes sharing a base id are not conflated, a stored
// registration never pairs while two live requests share its base id, and the
// duplicate memory stays bounded under a flood of registrations.
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { afterEach, describe, expect, it } from 'vitest';
import { PushError } from '../../lib';
import { type PushRegistration, encodePushReg } from '../../lib/kv/push/reg';
import { RegistrationStore } from '../../lib/kv/push/pairing';
import { PushPair, blockOf } from './push-helpers';

let t: PushPair | undefined;
afterEach(async () => {
  await t?.close();
  t = undefined;
});

const untouched = (p: PushPair, b: number) => blockOf(p.dmem, 0, b).every((x) => x === 0);

describe('push pairing', () => {
  it('a second decode request sharing the base id of one being pushed is not a duplicate: it pairs with the next request', async () => {
    t = await PushPair.start();
    const x = t.sender.offer('cmpl-z-11111111', [1]);
    const ra = t.receiver.receive(t.params(), { requestId: 'cmpl-z-aaaaaaaa', localBlockIds: [3], timeoutMs: 3000 });
    const rb = t.receiver.receive(t.params(), { requestId: 'cmpl-z-bbbbbbbb', localBlockIds: [4], timeoutMs: 3000 });
    expect((await x).decodeRequestId).toBe('cmpl-z-aaaaaaaa');
    await ra;
    const y = await t.sender.offer('cmpl-z-22222222', [2]);
    expect(y).toMatchObject({ reason: 'written', decodeRequestId: 'cmpl-z-bbbbbbbb' });
    expect((await rb).notifications).toBe(1);
    expect(t.same([1, 2], [3, 4])).toBe(true);
    expect(t.sender.stats.duplicates).toBe(0);
  });

  it('a stored registration does not pair with a new request while another live request shares its base id', async () => {
    t = await PushPair.start();
    const x = t.sender.offer('cmpl-y-11111111', [1]);
    const z = t.sender.offer('cmpl-y-33333333', [1]);
    const got = t.receiver
      .receive(t.params(), { requestId: 'cmpl-y-cccccccc', localBlockIds: [5], timeoutMs: 500 })
      .catch((e: unknown) => e);
    await new Promise((r) => setTimeout(r, 100));
    expect(t.sender.pending.registrations).toBe(1);
    t.sender.abort('cmpl-y-33333333');
    const y = t.sender.offer('cmpl-y-22222222', [2]);
    expect(await got).toBeInstanceOf(PushError);
    expect(untouched(t, 5)).toBe(true);
    for (const id of ['cmpl-y-11111111', 'cmpl-y-22222222']) t.sender.abort(id);
    expect((await Promise.all([x, y, z])).map((s) => s.reason)).toEqual(['aborted', 'aborted', 'aborted']);
  });

  it('a flood of registrations keeps the duplicate memory bounded (distinct ids, each waiting a moment)', async () => {
    t = await PushPair.start({ sender: { maxPendingRegistrations: 8 } });
    const p = t;
    p.dAgent.addRemoteAgent(p.pAgent.getAgentMetadata());
    const reg = (i: number): PushRegistration => ({
      requestId: `flood-${i}`,
      decodeEngineId: 'D',
      decodeHost: '127.0.0.1',
      decodePort: p.dServer.basePort,
      decodeTpSize: 1,
      localBlockIds: [[1]],
      remoteEngineId: 'P',
      remoteHost: '127.0.0.1',
      remotePort: p.pServer.basePort,
      remoteTpSize: 1,
      remotePpSize: 1,
      deadlineMs: 1,
    });
    const n = 3000;
    for (let i = 0; i < n; i++) {
      p.dAgent.sendNotif('push-p', encodePushReg(reg(i)));
      if (i % 100 === 99) await new Promise((r) => setTimeout(r, 2));
    }
    await expect.poll(() => p.sender.stats.registrations, { timeout: 10_000 }).toBe(n);
    expect(p.sender.resources().seenRegistrations).toBeLessThanOrEqual(1024);
    expect(p.sender.resources().registrations).toBeLessThanOrEqual(8);
  });

  it('the store: the seen set is capped (oldest forgotten), the waiting set evicts past its cap', () => {
    const s = new RegistrationStore(4, 480_000, 16, { max: 4, maxBytes: 1 << 20, perAgent: 4, perEngine: 4 });
    const r = (i: number, from = 'd0') => ({
      reg: { requestId: `r-${i}`, decodeEngineId: 'D', localBlockIds: [[i]] } as PushRegistration,
      from,
      at: performance.now(),
      deadlineAt: Number.POSITIVE_INFINITY,
    });
    for (let i = 0; i < 100; i++) expect(s.see(r(i))).toBeUndefined();
    expect(s.seen).toBe(16);
    expect(s.see(r(99))).toBe('duplicate');
    expect(s.see(r(99, 'd1'))).toBeUndefined();
    for (let i = 0; i < 4; i++) expect(s.add(r(i))).toEqual({ evicted: [] });
    // Full: the heaviest sender's (here the only one's) oldest makes room.
    expect(s.add(r(4)).evicted.map((x) => x.r.reg.requestId)).toEqual(['r-0']);
    expect(s.size).toBe(4);
    expect(s.candidate('r-2', performance.now())?.map((x) => x.reg.requestId)).toEqual(['r-2']);
    expect(s.candidate('r-0', performance.now())).toBeUndefined();
  });

  it('the store: a full store evicts the heaviest sender oldest first, never a lighter one', () => {
    const s = new RegistrationStore(8, 480_000, 1024, { max: 8, maxBytes: 1 << 20, perAgent: 8, perEngine: 8 });
    let n = 0;
    const r = (from: string, engine = from) => ({
      reg: { requestId: `r-${n++}`, decodeEngineId: engine, localBlockIds: [[1]] } as PushRegistration,
      from,
      at: performance.now(),
      deadlineAt: Number.POSITIVE_INFINITY,
    });
    for (let i = 0; i < 2; i++) s.add(r('real'));
    for (let i = 0; i < 6; i++) s.add(r('flooder'));
    const gone = [0, 1, 2].flatMap(() => s.add(r('third')).evicted.map((x) => `${x.r.from}:${x.r.reg.requestId}`));
    // The flooder (6, then 5, 4 against 'third''s 0, 1, 2) loses its three oldest; 'real' keeps both.
    expect(gone).toEqual(['flooder:r-2', 'flooder:r-3', 'flooder:r-4']);
    expect(s.candidate('r-0', performance.now())).toHaveLength(1);
    expect(s.candidate('r-1', performance.now())).toHaveLength(1);
  });

  it('the store: an agent naming another decode engine fills that engine quota with its own, and loses its own', () => {
    const s = new RegistrationStore(64, 480_000, 1024, { max: 64, maxBytes: 1 << 20, perAgent: 64, perEngine: 4 });
    let n = 0;
    const r = (from: string) => ({
      reg: { requestId: `r-${n++}`, decodeEngineId: 'D', localBlockIds: [[1, 2, 3]] } as PushRegistration,
      from,
      at: performance.now(),
      deadlineAt: Number.POSITIVE_INFINITY,
    });
    expect(s.add(r('d-rank0')).evicted).toEqual([]);
    const gone = Array.from({ length: 10 }, () => s.add(r('spoofer')).evicted.map((x) => x.r.from)).flat();
    expect(gone).toEqual(Array(7).fill('spoofer'));
    expect(s.candidate('r-0', performance.now())).toHaveLength(1);
    // The decode's own next registration evicts the spoofer's oldest, not its own.
    expect(s.add(r('d-rank0')).evicted.map((x) => x.r.from)).toEqual(['spoofer']);
    expect(s.size).toBe(4);
  });

  it('the store: registrations taken or evicted are not held on (their block lists can be collected)', async () => {
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    const s = new RegistrationStore(4096, 480_000);
    const refs: WeakRef<object>[] = [];
    for (let i = 0; i < 1000; i++) {
      const r = {
        reg: { requestId: `t-${i}`, decodeEngineId: `D${i}`, localBlockIds: [[i]] } as PushRegistration,
        from: `d${i}`,
        at: performance.now(),
        deadlineAt: Number.POSITIVE_INFINITY,
      };
      s.add(r);
      refs.push(new WeakRef(r));
      s.take(`D${i}\0t-${i}`);
    }
    expect(s.size).toBe(0);
    await new Promise((r) => setTimeout(r, 0));
    gc();
    // A few may wait for the next rebuild of the expiry queue; not all 1,000 for 480 s.
    expect(refs.filter((w) => w.deref() !== undefined).length).toBeLessThan(100);
  });
});
