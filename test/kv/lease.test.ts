// The prefill tracker's notification counting in both profiles, and v12
// leases: heartbeats extend them to max(old, now + 2/3 lease), expiry frees
// the blocks, a read after expiry is not taken for a new request. The clock
// and the timers are fake; the notifications are real (loopback agents).
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { NixlAgent, PrefillTracker } from '../../lib';
import type { Released } from '../../lib/kv';

const quiet = {
  lines: [] as string[],
  warn(m: string) {
    this.lines.push(m);
  },
};
let P: NixlAgent, D: NixlAgent;

beforeEach(() => {
  P = new NixlAgent('lease-P', { engine: 'loopback' });
  D = new NixlAgent('lease-D', { engine: 'loopback' });
  D.addRemoteAgent(P.getAgentMetadata());
  quiet.lines = [];
});
afterEach(() => {
  vi.useRealTimers();
  D.close();
  P.close();
});

/** Waits on the real event loop (setImmediate is not faked) until cond holds. */
async function until(cond: () => boolean, what: string): Promise<void> {
  for (let i = 0; i < 20000 && !cond(); i++) await new Promise((r) => setImmediate(r));
  if (!cond()) throw new Error(`timed out waiting for ${what}`);
}

function settled(p: Promise<Released>): () => Released | undefined {
  let r: Released | undefined;
  void p.then((x) => (r = x));
  return () => r;
}

describe('v12 leases (fake clock)', () => {
  it("a hold of its own length that heartbeats do not extend (a decode's finished turn)", async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const t = new PrefillTracker({ agent: P, tpSize: 1, wire: 'v12', now: () => Date.now(), logger: quiet });
    const t0 = Date.now();
    const turn = settled(t.expect('turn', [4, 5], { leaseMs: 8000, renewable: false }));
    const kv = settled(t.expect('kv', [6]));
    expect(t.leaseExpiry('turn')).toBe(t0 + 8000);
    vi.advanceTimersByTime(7000);
    D.sendNotif('lease-P', 'HB:turn,kv');
    await until(() => t.heartbeats === 1, 'heartbeat');
    expect(t.leaseExpiry('turn')).toBe(t0 + 8000);
    expect(t.leaseExpiry('kv')).toBe(t0 + 30_000);
    vi.advanceTimersByTime(1001);
    await until(() => turn() !== undefined, 'turn expiry');
    expect(turn()).toEqual({ requestId: 'turn', blockIds: [4, 5], reason: 'expired' });
    expect(kv()).toBeUndefined();
    expect(() => t.expect('bad', [1], { leaseMs: 0 })).toThrow(/leaseMs must be positive/);
    await t.close();
  });

  it('a heartbeat extends the lease to max(old, now + 2/3 lease); expiry frees the blocks', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const t = new PrefillTracker({ agent: P, tpSize: 1, wire: 'v12', now: () => Date.now(), logger: quiet });
    const t0 = Date.now();
    const r1 = settled(t.expect('r1', [1, 2]));
    const r2 = settled(t.expect('r2', [3]));
    expect(t.leaseExpiry('r1')).toBe(t0 + 30_000);

    // At 1 s a heartbeat would give 21 s: the lease stays at 30 s.
    vi.advanceTimersByTime(1000);
    D.sendNotif('lease-P', 'HB:r1');
    await until(() => t.heartbeats === 1, 'heartbeat 1');
    expect(t.leaseExpiry('r1')).toBe(t0 + 30_000);

    // At 25 s: r1 goes to 45 s; unknown ids are ignored.
    vi.advanceTimersByTime(24_000);
    D.sendNotif('lease-P', 'HB:r1,nobody');
    await until(() => t.heartbeats === 2, 'heartbeat 2');
    expect(t.leaseExpiry('r1')).toBe(t0 + 45_000);

    vi.advanceTimersByTime(5001); // 30 s: r2 expires, r1 does not
    await until(() => r2() !== undefined, 'r2 expiry');
    expect(r2()).toEqual({ requestId: 'r2', blockIds: [3], reason: 'expired' });
    expect(r1()).toBeUndefined();
    vi.advanceTimersByTime(14_000); // 44 s
    await new Promise((r) => setImmediate(r));
    expect(r1()).toBeUndefined();
    vi.advanceTimersByTime(1000); // 45 s
    await until(() => r1() !== undefined, 'r1 expiry');
    expect(r1()).toMatchObject({ requestId: 'r1', reason: 'expired' });
    expect(t.pending).toBe(0);

    // A read that comes after the lease ran out is not taken for a new request of that id.
    D.sendNotif('lease-P', 'r1:1');
    await until(() => quiet.lines.some((l) => /after its lease ran out/.test(l)), 'late read warning');
    const again = settled(t.expect('r1', [7]));
    await new Promise((r) => setImmediate(r));
    expect(again()).toBeUndefined();
    D.sendNotif('lease-P', 'r1:1');
    await until(() => again() !== undefined, 'r1 read');
    expect(again()).toMatchObject({ reason: 'read', blockIds: [7] });
    await t.close();
  });

  it('kv_lease_duration is an option (leaseMs); v0.13 holds 480 s by default', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const t12 = new PrefillTracker({
      agent: P,
      tpSize: 1,
      wire: 'v12',
      leaseMs: 6000,
      now: () => Date.now(),
      logger: quiet,
    });
    const t013 = new PrefillTracker({ agent: D, tpSize: 1, wire: 'v0.13', now: () => Date.now(), logger: quiet });
    const t0 = Date.now();
    void t12.expect('a', [1]);
    void t013.expect('b', [1]);
    expect(t12.leaseExpiry('a')).toBe(t0 + 6000);
    expect(t013.leaseExpiry('b')).toBe(t0 + 480_000);
    await t12.close();
    await t013.close();
  });
});

describe('completion counting', () => {
  it('v12: the number after ":" is how many reads to wait for', async () => {
    const t = new PrefillTracker({ agent: P, tpSize: 2, wire: 'v12', logger: quiet });
    const one = settled(t.expect('one', [1]));
    const two = settled(t.expect('two:with:colons', [2]));
    D.sendNotif('lease-P', 'one:1');
    await until(() => one() !== undefined, 'one');
    D.sendNotif('lease-P', 'two:with:colons:2');
    await new Promise((r) => setTimeout(r, 50));
    expect(two()).toBeUndefined();
    D.sendNotif('lease-P', 'two:with:colons:2');
    await until(() => two() !== undefined, 'two');
    expect(two()).toMatchObject({ requestId: 'two:with:colons', reason: 'read' });
    await t.close();
  });

  it('v0.13: the number is the decode TP size; prefill TP 2 waits for 4 / 2 reads', async () => {
    const t = new PrefillTracker({ agent: P, tpSize: 2, wire: 'v0.13', logger: quiet });
    const r = settled(t.expect('req', [1]));
    D.sendNotif('lease-P', 'req:4');
    await new Promise((res) => setTimeout(res, 50));
    expect(r()).toBeUndefined();
    D.sendNotif('lease-P', 'req:4');
    await until(() => r() !== undefined, 'req');
    // A v12 decode's "req:2" means 2 reads there, but here (v0.13) TP 2 -> 1 read.
    const s = settled(t.expect('s', [1]));
    D.sendNotif('lease-P', 's:2');
    await until(() => s() !== undefined, 's');
    await t.close();
  });
});
