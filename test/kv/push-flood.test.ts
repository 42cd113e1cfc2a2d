// A PUSH_REG flood (issue 44): one peer that handshaked with a push prefill
// sends well-formed registrations for requests that never come. Its
// registrations are bounded per sending agent, per decode engine and in
// bytes, the flooder's are evicted before anyone else's, and every
// registration not kept is refused at once (NIXL_NODE_PUSH_REFUSED), so a
// real decode still pairs, or fails fast as `refused`, never at its deadline.
import { afterEach, describe, expect, it } from 'vitest';
import { NixlAgent, PushError } from '../../lib';
import { type PushRegistration, decodeRefusal, encodePushReg } from '../../lib/kv/push/reg';
import { ENGINE, PushPair } from './push-helpers';

let t: PushPair | undefined;
const agents: NixlAgent[] = [];
afterEach(async () => {
  await t?.close();
  t = undefined;
  for (const a of agents.splice(0)) a.close();
});

/** An agent that knows the prefill (as after a handshake) and that the prefill knows (so refusals reach it). */
function flooder(p: PushPair, name = 'flooder'): NixlAgent {
  const a = new NixlAgent(name, { engine: ENGINE });
  agents.push(a);
  a.addRemoteAgent(p.pAgent.getAgentMetadata());
  p.pAgent.addRemoteAgent(a.getAgentMetadata());
  return a;
}

/** A well-formed registration for engine P of a request that never comes. */
function bogus(p: PushPair, i: number, blocks = 1): Buffer {
  const reg: PushRegistration = {
    requestId: `flood-${i}`,
    decodeEngineId: 'X',
    decodeHost: '127.0.0.1',
    decodePort: p.dServer.basePort,
    decodeTpSize: 1,
    localBlockIds: [Array.from({ length: blocks }, (_, k) => (k * 7 + i) % 100)],
    remoteEngineId: 'P',
    remoteHost: '127.0.0.1',
    remotePort: p.pServer.basePort,
    remoteTpSize: 1,
    remotePpSize: 1,
    confirm: true,
  };
  return encodePushReg(reg);
}

/** Sends n registrations from `a` (yielding now and then, as a peer on a socket would) and waits until all were read. */
async function flood(p: PushPair, a: NixlAgent, n: number, blocks = 1, from = 0): Promise<void> {
  const before = p.sender.stats.registrations;
  for (let i = from; i < from + n; i++) {
    a.sendNotif('push-p', bogus(p, i, blocks));
    if (i % 200 === 199) await new Promise((r) => setTimeout(r, 1));
  }
  await expect.poll(() => p.sender.stats.registrations - before, { timeout: 20_000, interval: 20 }).toBe(n);
}

/** The request ids refused to `a` so far. */
function refusals(a: NixlAgent): string[] {
  return (a.getNewNotifs().get('push-p') ?? []).map((m) => decodeRefusal(m.toString('utf8'))?.requestId ?? '?');
}

describe('a PUSH_REG flood', () => {
  it('one agent flooding past the store (4,100 > 4,096) does not lock another decode out: it pairs and is written', async () => {
    t = await PushPair.start();
    await flood(t, flooder(t), 4100);
    // The registration reaches the prefill before its offer (a prefill slower than the decode).
    const got = t.receiver.receive(t.params(), { requestId: 'real-1', localBlockIds: [3, 4], timeoutMs: 4000 });
    await expect.poll(() => t!.sender.stats.registrations, { timeout: 5000 }).toBe(4101);
    const sent = await t.sender.offer('real-1', [7, 8]);
    expect(sent.reason).toBe('written');
    expect((await got).notifications).toBe(1);
    expect(t.same([7, 8], [3, 4])).toBe(true);
    // The flooder holds at most its quota (a quarter of the store by default).
    expect(t.sender.pending.registrations).toBeLessThanOrEqual(1025);
  }, 60_000);

  it("a full store evicts the flooding agent's oldest registration, refused to it at once; the newcomer is kept", async () => {
    t = await PushPair.start({
      sender: { maxPendingRegistrations: 8, maxPendingRegistrationsPerAgent: 8, maxPendingRegistrationsPerEngine: 8 },
    });
    const a = flooder(t);
    await flood(t, a, 8);
    expect(t.sender.pending.registrations).toBe(8);
    const got = t.receiver.receive(t.params(), { requestId: 'real-2', localBlockIds: [5], timeoutMs: 4000 });
    await expect.poll(() => t!.sender.stats.registrations, { timeout: 5000 }).toBe(9);
    expect(t.sender.pending.registrations).toBe(8);
    const sent = await t.sender.offer('real-2', [9]);
    expect(sent.reason).toBe('written');
    await got;
    expect(t.same([9], [5])).toBe(true);
    await expect.poll(() => refusals(a), { timeout: 2000 }).toEqual(['flood-0']);
    expect(t.sender.stats.evicted).toBe(1);
  });

  it('a decode over its own quota: its oldest registration is evicted and its receive fails fast as refused', async () => {
    t = await PushPair.start({ sender: { maxPendingRegistrationsPerAgent: 2 } });
    const t0 = performance.now();
    const opts = (id: string, b: number) => ({ requestId: id, localBlockIds: [b], timeoutMs: 8000 });
    const r1 = t.receiver.receive(t.params(), opts('q-1', 1)).catch((e: unknown) => e);
    const r2 = t.receiver.receive(t.params(), opts('q-2', 2));
    const r3 = t.receiver.receive(t.params(), opts('q-3', 3));
    const e = await r1;
    expect(e).toBeInstanceOf(PushError);
    expect(e).toMatchObject({ kind: 'refused' });
    expect((e as PushError).message).toMatch(/evicted|quota/);
    // Refused at once, not at its deadline (8 s).
    expect(performance.now() - t0).toBeLessThan(6000);
    for (const [id, b] of [
      ['q-2', 12],
      ['q-3', 13],
    ] as const)
      expect((await t.sender.offer(id, [b])).reason).toBe('written');
    await Promise.all([r2, r3]);
    expect(t.same([12, 13], [2, 3])).toBe(true);
    expect(t.sender.stats.evicted).toBe(1);
  });

  it('registrations are bounded in bytes: large block lists are evicted by their cost, each refused', async () => {
    // 60,000 block ids (under loopback's 64 KiB notification cap) cost about 0.9 MB each; a 16 MiB budget gives one agent a quarter of it.
    t = await PushPair.start({ sender: { maxPendingRegistrationBytes: 16 << 20 } });
    const a = flooder(t);
    await flood(t, a, 40, 60_000);
    const kept = t.sender.pending.registrations;
    expect(kept).toBeGreaterThan(0);
    expect(kept).toBeLessThanOrEqual(4);
    expect(t.sender.pending.registrationBytes).toBeLessThanOrEqual(4 << 20);
    await expect.poll(() => refusals(a).length, { timeout: 5000 }).toBe(40 - kept);
    // Another decode still gets in and is written.
    const got = t.receiver.receive(t.params(), { requestId: 'real-3', localBlockIds: [6], timeoutMs: 4000 });
    await expect.poll(() => t!.sender.stats.registrations, { timeout: 5000 }).toBe(41);
    expect((await t.sender.offer('real-3', [10])).reason).toBe('written');
    await got;
  }, 60_000);

  it('a registration larger than one agent may keep is refused at once (nothing evicted for it)', async () => {
    t = await PushPair.start({ sender: { maxPendingRegistrationBytes: 1 << 20 } });
    const a = flooder(t);
    await flood(t, a, 1, 60_000);
    expect(t.sender.pending.registrations).toBe(0);
    await expect.poll(() => refusals(a), { timeout: 2000 }).toEqual(['flood-0']);
    expect(t.sender.stats.refused).toBe(1);
  });
});
