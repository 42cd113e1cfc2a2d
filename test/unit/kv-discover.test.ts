// Which advertised publishers the proxy follows: each one once, again when it
// moves, not when it stops advertising, never over an explicit endpoint, and
// not when the proxy's index cannot key its block size (refused once, counted).
import { describe, expect, it } from 'vitest';
import { KeySize } from '../../lib/serving/kv-index/block-size';
import { AdvertisedFollower, type FollowSink } from '../../lib/serving/kv-index/discover';
import type { WorkerRef } from '../../lib/serving/proxy/worker-ref';

function ref(address: string, kv?: Partial<NonNullable<WorkerRef['kvEvents']>>, fleet?: string): WorkerRef {
  const kvEvents = kv ? { endpoint: 'tcp://127.0.0.1:5556', replay_endpoint: null, topic: '', ...kv } : undefined;
  return { address, stage: 'prefill', healthy: true, outstanding: 0, failures: 0, kvEvents, fleet };
}

function sink(blockSize?: number) {
  const log: string[] = [];
  const key = new KeySize(blockSize);
  const s: FollowSink & { log: string[]; readonly size?: number } = {
    log,
    get size() {
      return key.value;
    },
    subscribe: (n, ep) => log.push(`sub ${n} ${ep.pub} ${ep.replay ?? '-'}`),
    unsubscribe: (n) => log.push(`unsub ${n}`),
    refuses: (size) => {
      const v = key.consider(size);
      return v.follow ? undefined : v.why;
    },
    refuse: (n, why) => log.push(`refuse ${n} ${why.slice(0, 24)}`),
    info: () => {},
  };
  return s;
}

describe('following advertised KV-event publishers', () => {
  it('subscribes once, again when the endpoint moves, and drops one that stops advertising or leaves', () => {
    const s = sink();
    const f = new AdvertisedFollower(s);
    const a = ref('http://h:1', { replay_endpoint: 'tcp://127.0.0.1:5557', block_size: 32 });
    const b = ref('http://h:2', { endpoint: 'tcp://127.0.0.1:6556' }, 'wb');
    const plain = ref('http://h:3');
    f.sync([a, b, plain], new Set());
    f.sync([a, b, plain], new Set());
    expect(s.log).toEqual([
      'sub http://h:1 tcp://127.0.0.1:5556 tcp://127.0.0.1:5557',
      'sub wb tcp://127.0.0.1:6556 -',
    ]);
    expect(s.size).toBe(32); // adopted from the first advertisement
    expect(f.names.sort()).toEqual(['http://h:1', 'wb']);
    s.log.length = 0;
    b.kvEvents = { ...b.kvEvents!, endpoint: 'tcp://127.0.0.1:7556' };
    a.kvEvents = undefined;
    f.sync([a, b, plain], new Set());
    expect(s.log).toEqual(['unsub http://h:1', 'unsub wb', 'sub wb tcp://127.0.0.1:7556 -']);
    s.log.length = 0;
    f.sync([plain], new Set());
    expect(s.log).toEqual(['unsub wb']);
    expect(f.names).toEqual([]);
  });

  it('an explicit endpoint (by address or fleet name) wins over the advertisement', () => {
    const s = sink();
    const f = new AdvertisedFollower(s);
    f.sync([ref('http://h:1', {}), ref('http://h:2', {}, 'w2')], new Set(['http://h:1', 'w2']));
    expect(s.log).toEqual([]);
  });

  it("follows a block size that is a multiple of the proxy's; refuses, once, one that is not, until it is", () => {
    const s = sink(16);
    const f = new AdvertisedFollower(s);
    const m = ref('http://h:2', { block_size: 512, endpoint: 'tcp://127.0.0.1:6556' });
    const a = ref('http://h:1', { block_size: 24 });
    f.sync([a, m], new Set());
    f.sync([a, m], new Set());
    expect(s.log).toEqual(['refuse http://h:1 advertises block_size 24', 'sub http://h:2 tcp://127.0.0.1:6556 -']);
    a.kvEvents = { ...a.kvEvents!, block_size: 32 };
    f.sync([a, m], new Set());
    expect(s.log.at(-1)).toBe('sub http://h:1 tcp://127.0.0.1:5556 -');
    expect(s.size).toBe(16);
    // No block size advertised: followed (its events say).
    const g = new AdvertisedFollower(sink(16));
    g.sync([ref('http://h:9', {})], new Set());
    expect(g.names).toEqual(['http://h:9']);
  });
});

describe('precise, for a prompt no prefill holds', () => {
  it("goes where the 'load' policy's prefix affinity sends it, whatever the turn", async () => {
    const { PreciseRouting } = await import('../../lib/serving/kv-index/precise');
    const workers = ['http://h:1', 'http://h:2', 'http://h:3'].map((a) => ref(a));
    const r = new PreciseRouting({}, undefined, undefined, { workers });
    const picked = new Set(
      [0, 1, 2, 3, 4, 5].map((turn) =>
        r.pick(workers, { keys: [100 + turn], affinity: `m\n${'p'.repeat(200)}` }, turn),
      ),
    );
    expect(picked.size).toBe(1);
    // (Other keys each turn: no speculative entry decides.) Without an affinity (a short prompt): ties in turn.
    const spread = new Set([0, 1, 2].map((turn) => r.pick(workers, { keys: [200 + turn] }, turn)));
    expect(spread.size).toBe(3);
    r.close();
  });
});
