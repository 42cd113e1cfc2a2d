// The subscriber's sockets against a publisher of older vLLM (before
// v0.26.0): replay replies without the topic frame, ended by seq 2^64-1; a
// live gap asks for a replay from last+1 over the same DEALER.
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
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

async function until(what: () => boolean, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((r) => setTimeout(r, 20));
  }
}

describe('KV event subscriber sockets', () => {
  it('takes topic-less replay replies (vLLM < 0.26), and replays a live gap from last+1', async () => {
    const pub = new zmq.Publisher();
    const router = new zmq.Router();
    await pub.bind('tcp://127.0.0.1:*');
    await router.bind('tcp://127.0.0.1:*');
    closers.push(
      () => pub.close(),
      () => router.close(),
    );
    const buffer = [0n, 1n, 2n, 3n, 4n, 5n].map((s) => [s, Buffer.from(`batch ${s}`)] as const);
    const asked: bigint[] = [];
    void (async () => {
      try {
        for await (const [id, , start] of router) {
          const from = start.readBigUInt64BE(0);
          asked.push(from);
          // Before #45177: [seq, payload] after the delimiter; ends with [ff..ff, b""].
          for (const [s, p] of buffer)
            if (s >= from && s <= (asked.length === 1 ? 1n : 5n)) await router.send([id, '', seq(s), p]);
          await router.send([id, '', seq((1n << 64n) - 1n), Buffer.alloc(0)]);
        }
      } catch {
        // closed
      }
    })();
    const applied: string[] = [];
    const counts: Record<string, number> = {};
    const sub = new EventSubscriber(
      { pub: pub.lastEndpoint!, replay: router.lastEndpoint! },
      {
        apply: (s, p) => applied.push(`${s}:${Buffer.from(p).toString()}`),
        clear: () => applied.push('clear'),
        count: (w) => {
          counts[w] = (counts[w] ?? 0) + 1;
        },
      },
      () => {
        counts.malformed = (counts.malformed ?? 0) + 1;
      },
    );
    closers.push(() => sub.close());
    sub.start();
    await until(() => applied.length === 2 && !sub.stream.replaying);
    expect(applied).toEqual(['0:batch 0', '1:batch 1']);
    // Live 4 and 5 arrive; 2 and 3 never did: the subscriber replays from 2.
    await until(() => {
      if (applied.length < 6) {
        void pub.send(['kv', seq(4n), buffer[4][1]]);
        void pub.send(['kv', seq(5n), buffer[5][1]]);
      }
      return applied.length >= 6;
    });
    expect(asked).toEqual([0n, 2n]);
    expect(applied).toEqual(['0:batch 0', '1:batch 1', '2:batch 2', '3:batch 3', '4:batch 4', '5:batch 5']);
    expect(counts).toMatchObject({ replays: 2, gaps: 1 });
    expect(counts.replay_lost).toBeUndefined();
  }, 30_000);
});
