// Shared by the precise-routing tests: a completion or chat through the proxy
// that answers 200 and says which prefill served it and how much prefix it
// matched, workers and a proxy set up as these tests set them up, and a
// publisher of vLLM-format events of the test's own making.
import { expect } from 'vitest';
import * as zmq from 'zeromq';
import { type KvEvent as PeerEvent, encodeBatch } from '../../lib/serving/worker/kv-events/encode';
import { type ProxyOptions, type Worker, startProxy, startWorker } from '../../lib/serving';
import type { ServingProxy } from '../../lib/serving/proxy/proxy';

export async function complete(proxy: ServingProxy, prompt: string) {
  const r = await fetch(`${proxy.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'nixl-node/synthetic', prompt, max_tokens: 2 }),
  });
  expect(r.status).toBe(200);
  return (await r.json()) as { nixl_node: { prefill: string; prefix_match_tokens: number } };
}

/** A two-token chat through the proxy (`system`, then `question`) that answers 200: who prefilled it, how much it matched. */
export async function chat(proxy: ServingProxy, system: string, question: string, extra: Record<string, unknown> = {}) {
  const r = await fetch(`${proxy.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'nixl-node-tiny',
      messages: [
        { role: 'system', content: system },
        { role: 'user', content: question },
      ],
      max_tokens: 2,
      ...extra,
    }),
  });
  expect(r.status).toBe(200);
  return ((await r.json()) as { nixl_node: { prefill: string; prefix_match_tokens: number } }).nixl_node;
}

/** `n` synthetic workers over HTTP, each closed by `closers` (run last first). */
export async function httpWorkers(n: number, closers: Array<() => unknown>): Promise<Worker[]> {
  const out: Worker[] = [];
  for (let i = 0; i < n; i++) {
    const w = await startWorker({ transport: 'http' });
    closers.push(() => w.close());
    out.push(w);
  }
  return out;
}

/** A precise-routing proxy over HTTP to static workers, with no health checks (only `kvEvents` says where events are), closed by `closers`. */
export async function staticPreciseProxy(
  prefill: Worker[],
  decode: Worker[],
  kvEvents: ProxyOptions['kvEvents'],
  closers: Array<() => unknown>,
): Promise<ServingProxy> {
  const proxy = await startProxy({
    transport: 'http',
    prefill: prefill.map((w) => w.address),
    decode: decode.map((w) => w.address),
    healthIntervalMs: 0,
    policy: 'precise',
    kvEvents,
  });
  closers.push(() => proxy.close());
  return proxy;
}

/**
 * Workers and a precise-routing proxy that meet in etcd at `url` under
 * `prefix`: `role` is a worker's etcd option, `proxy` starts the proxy (no
 * health checks: only the records say where the events are).
 */
export function etcdFleet(url: string, prefix: string) {
  return {
    role: (role: 'prefill' | 'decode') => ({ endpoints: [url], prefix, role, ttlSec: 5, drainMs: 500 }),
    proxy: () =>
      startProxy({
        etcd: { endpoints: [url], prefix, resyncMs: 500 },
        healthIntervalMs: 0,
        policy: 'precise',
        kvEvents: { index: { speculativeTtlMs: 1 } },
      }),
  };
}

/**
 * A vLLM-format publisher for tests that need events of their own making (a
 * block size other than the workers', a gap): PUB [topic, seq, msgpack] and a
 * ROUTER that replays what it keeps, as vLLM's ZmqEventPublisher does. The
 * next `skip` batches are kept for replay but never sent live (a gap).
 */
export class EventPeer {
  readonly pub = new zmq.Publisher();
  readonly router = new zmq.Router();
  readonly #kept: [Buffer, Buffer][] = [];
  #seq = 0n;
  skip = 0;

  static async open(): Promise<EventPeer> {
    const p = new EventPeer();
    await p.pub.bind('tcp://127.0.0.1:*');
    await p.router.bind('tcp://127.0.0.1:*');
    void p.#serve();
    return p;
  }

  get endpoint(): { pub: string; replay: string } {
    return { pub: this.pub.lastEndpoint!, replay: this.router.lastEndpoint! };
  }

  async #serve(): Promise<void> {
    for await (const [id, , start] of this.router) {
      const from = start.readBigUInt64BE();
      for (const [seq, payload] of this.#kept)
        if (seq.readBigUInt64BE() >= from) await this.router.send([id, Buffer.alloc(0), TOPIC, seq, payload]);
      await this.router.send([id, Buffer.alloc(0), Buffer.alloc(0), Buffer.alloc(8, 0xff), Buffer.alloc(0)]);
    }
  }

  /** Publishes one batch of events. */
  async send(...events: PeerEvent[]): Promise<void> {
    const seq = Buffer.alloc(8);
    seq.writeBigUInt64BE(this.#seq++);
    const payload = encodeBatch(events, { ts: Date.now() / 1000 });
    this.#kept.push([seq, payload]);
    if (this.skip > 0) this.skip--;
    else await this.pub.send([TOPIC, seq, payload]);
  }

  close(): void {
    this.pub.close();
    this.router.close();
  }
}

const TOPIC = Buffer.from('kv-test');

/** A BlockStored of `text`'s UTF-8 bytes (the synthetic model's token ids), `blockSize` tokens per hash. */
export function storedText(text: string, blockSize: number, hashes: bigint[], parent: bigint | null = null): PeerEvent {
  const tokenIds = [...Buffer.from(text, 'utf8')];
  if (tokenIds.length !== blockSize * hashes.length) throw new Error('storedText: not whole blocks');
  return { type: 'BlockStored', blockHashes: hashes, parentBlockHash: parent, tokenIds, blockSize };
}

/** Waits until `what` holds (10 s at most). */
export async function until(what: () => boolean, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((r) => setTimeout(r, 20));
  }
}
