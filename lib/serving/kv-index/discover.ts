// Which prefill workers' KV events the proxy follows without being told:
// every worker of the pool that advertises a publisher (kv_events in its
// /health answer or its etcd record). An endpoint given for a worker with
// --kv-events-endpoint wins over what it advertises. A worker that leaves,
// stops advertising or moves its publisher is unsubscribed (its index goes);
// one whose block size the proxy's index cannot key (not a whole multiple of
// the proxy's, block-size.ts) is refused.
import type { WorkerRef } from '../proxy/worker-ref';
import type { EventEndpoint } from './subscriber';

/** One advertised publisher to follow. */
export interface Advertised {
  ep: EventEndpoint;
  /** Its endpoints as one string: a change means a new subscription. */
  sig: string;
  blockSize?: number;
}

/** The name a worker's events go by when it was not named on the command line: its fleet name, else its address. */
export const autoName = (w: WorkerRef): string => w.fleet ?? w.address;

/** The advertised publishers of `workers` not covered by an explicit endpoint (`explicit`: names given). */
export function advertised(workers: readonly WorkerRef[], explicit: ReadonlySet<string>): Map<string, Advertised> {
  const out = new Map<string, Advertised>();
  for (const w of workers) {
    const k = w.kvEvents;
    if (!k || explicit.has(w.address) || (w.fleet !== undefined && explicit.has(w.fleet))) continue;
    const ep: EventEndpoint = {
      pub: k.endpoint,
      ...(k.replay_endpoint ? { replay: k.replay_endpoint } : {}),
      ...(k.topic ? { topic: k.topic } : {}),
    };
    const sig = `${k.endpoint} ${k.replay_endpoint ?? ''} ${k.topic ?? ''}`;
    out.set(autoName(w), { ep, sig, blockSize: k.block_size });
  }
  return out;
}

/** What follows the advertised publishers: subscribe, unsubscribe, and the proxy's block size. */
export interface FollowSink {
  subscribe(name: string, ep: EventEndpoint): void;
  unsubscribe(name: string): void;
  /** Why a worker with blocks of `size` tokens cannot be followed, or undefined when it can (B may change for it). */
  refuses(size: number): string | undefined;
  /** An advertisement refused: counted and logged once per endpoint. */
  refuse(name: string, why: string): void;
  info(name: string, msg: string): void;
}

/** The subscriptions made from advertisements, kept in line with what the workers advertise. */
export class AdvertisedFollower {
  /** Name -> the endpoints subscribed to. */
  readonly #subscribed = new Map<string, string>();
  /** Name -> the endpoints refused (said once). */
  readonly #refused = new Map<string, string>();

  constructor(readonly sink: FollowSink) {}

  /** The workers followed from their advertisement. */
  get names(): string[] {
    return [...this.#subscribed.keys()];
  }

  /** The worker's subscription went elsewhere (it left the pool). */
  forget(name: string): void {
    this.#subscribed.delete(name);
    this.#refused.delete(name);
  }

  sync(workers: readonly WorkerRef[], explicit: ReadonlySet<string>): void {
    const want = advertised(workers, explicit);
    for (const [name, sig] of this.#subscribed)
      if (want.get(name)?.sig !== sig) {
        this.#subscribed.delete(name);
        this.sink.unsubscribe(name);
        this.sink.info(name, want.has(name) ? 'KV events publisher moved' : 'KV events no longer advertised');
      }
    for (const name of this.#refused.keys()) if (!want.has(name)) this.#refused.delete(name);
    for (const [name, a] of want) {
      if (this.#subscribed.has(name)) continue;
      const why = a.blockSize === undefined ? undefined : this.sink.refuses(a.blockSize);
      if (why !== undefined) {
        if (this.#refused.get(name) === a.sig) continue;
        this.#refused.set(name, a.sig);
        this.sink.refuse(name, `advertises ${why}`);
        continue;
      }
      this.#refused.delete(name);
      this.#subscribed.set(name, a.sig);
      this.sink.subscribe(name, a.ep);
      this.sink.info(name, `following the KV events it advertises at ${a.ep.pub}`);
    }
  }
}
