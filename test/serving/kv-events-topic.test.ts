// The subscriber's topic filter (vLLM's `topic`, llm-d's kv@<pod-ip>:<port>@<model>):
// one PUB socket may carry several workers' streams (a collector the workers
// connect to, vLLM's connect mode); a subscription with a topic takes only
// the messages of that topic, and a subscription without one takes every message.
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import { parseEventEndpoint } from '../../lib/serving/kv-index/precise';
import { EventSubscriber } from '../../lib/serving/kv-index/subscriber';

const seq = (n: bigint) => {
  const b = Buffer.alloc(8);
  b.writeBigUInt64BE(n);
  return b;
};
const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

function follow(pub: string, topic?: string): string[] {
  const applied: string[] = [];
  const sub = new EventSubscriber(
    topic === undefined ? { pub } : { pub, topic },
    { apply: (s, p) => applied.push(`${s}:${Buffer.from(p).toString()}`), clear: () => {}, count: () => {} },
    () => applied.push('malformed'),
  );
  closers.push(() => sub.close());
  sub.start();
  return applied;
}

describe('KV event topics', () => {
  it('a subscription with a topic takes only that topic from a shared PUB', async () => {
    const pub = new zmq.Publisher();
    await pub.bind('tcp://127.0.0.1:*');
    closers.push(() => pub.close());
    const a = follow(pub.lastEndpoint!, 'kv@10.0.0.1:8000@m');
    // A topic that starts with a's (ZeroMQ filters by prefix) is not a's either.
    const others = ['kv@10.0.0.2:8000@m', 'kv@10.0.0.1:8000@m2'];
    // The SUB joins asynchronously: send rounds until a has seen some, then two more.
    let extra = 2;
    for (let r = 0n; r < 300n && extra > 0; r++) {
      for (const t of others) await pub.send([t, seq(r), `from ${t}`]);
      await pub.send(['kv@10.0.0.1:8000@m', seq(r), 'from a']);
      await new Promise((res) => setTimeout(res, 30));
      if (a.length > 0) extra--;
    }
    expect(a.length).toBeGreaterThan(0);
    expect(a.every((m) => m.endsWith(':from a'))).toBe(true);
  });

  it('--kv-events-endpoint takes an optional topic', () => {
    expect(parseEventEndpoint('w=tcp://h:5557,tcp://h:5558,topic=kv@h:8000@m')).toEqual([
      'w',
      { pub: 'tcp://h:5557', replay: 'tcp://h:5558', topic: 'kv@h:8000@m' },
    ]);
    expect(parseEventEndpoint('w=tcp://h:5557,topic=kv@h:8000@m')).toEqual([
      'w',
      { pub: 'tcp://h:5557', topic: 'kv@h:8000@m' },
    ]);
  });
});
