// vLLM's ZmqEventPublisher: a PUB socket sends [topic, seq (u64 BE),
// payload] per batch, seq from 0 and +1 per batch; a ROUTER keeps the last
// `buffer_steps` batches and answers a replay request [id, "", start (u64
// BE)] with [id, "", topic, seq, payload] for each kept batch from start,
// then the end marker [id, "", "", ff x 8, ""] (vLLM #45177 and later).
// Sends are serialised (a zeromq.js socket takes one send at a time); a PUB
// past its high-water mark drops, as vLLM's does: consumers see the seq gap
// and replay.
import * as zmq from 'zeromq';
import { NixlError } from '../../../errors';
import { type KvEventsSettings, bindsEndpoint } from './config';
import { connectable } from './host';

/** The end-of-replay marker (seq -1). */
export const END_SEQ = Buffer.alloc(8, 0xff);

/** Where a consumer finds a worker's events (its /health and etcd record say it). */
export interface KvEventsInfo {
  /** The PUB address a SUB connects to (or the collector it connects to). */
  endpoint: string;
  /** The replay ROUTER's address, or null. */
  replay_endpoint: string | null;
  topic: string;
}

function seqFrame(seq: bigint): Buffer {
  const b = Buffer.alloc(8);
  b.writeBigUInt64BE(seq);
  return b;
}

export class KvEventPublisher {
  readonly #pub: zmq.Publisher;
  readonly #router?: zmq.Router;
  readonly #topic: Buffer;
  readonly #buffer: Array<{ seq: bigint; payload: Buffer }> = [];
  readonly #max: number;
  #seq = 0n;
  #chain: Promise<void> = Promise.resolve();
  #closed = false;
  info!: KvEventsInfo;
  /** Batches sent, replay requests served, and replay requests ignored as malformed. */
  readonly stats = { batches: 0, replays: 0, badReplays: 0 };

  private constructor(readonly settings: KvEventsSettings) {
    this.#topic = Buffer.from(settings.topic, 'utf8');
    this.#max = settings.bufferSteps;
    this.#pub = new zmq.Publisher({ sendHighWaterMark: settings.hwm, linger: 200 });
    if (settings.replayEndpoint) this.#router = new zmq.Router({ linger: 0 });
  }

  /** Binds (or connects) its sockets; `host`: the address peers reach this worker at. */
  static async open(settings: KvEventsSettings, host: string): Promise<KvEventPublisher> {
    const p = new KvEventPublisher(settings);
    try {
      let endpoint = settings.endpoint;
      if (bindsEndpoint(endpoint)) {
        await p.#pub.bind(endpoint);
        endpoint = connectable(p.#pub.lastEndpoint ?? endpoint, host);
      } else p.#pub.connect(endpoint);
      let replay: string | null = null;
      if (p.#router && settings.replayEndpoint) {
        await p.#router.bind(settings.replayEndpoint);
        replay = connectable(p.#router.lastEndpoint ?? settings.replayEndpoint, host);
        void p.#serveReplay(p.#router);
      }
      p.info = { endpoint, replay_endpoint: replay, topic: settings.topic };
      return p;
    } catch (e) {
      p.#pub.close();
      p.#router?.close();
      throw new NixlError(
        `KV events: cannot open ${settings.endpoint}: ${(e as Error).message}`,
        'NIXL_ERR_BACKEND',
        undefined,
        {
          cause: e,
        },
      );
    }
  }

  /** The next batch's sequence number (batches sent so far). */
  get nextSeq(): bigint {
    return this.#seq;
  }

  /** Sends one batch (its msgpack) and keeps it for replay. */
  publish(payload: Buffer): void {
    if (this.#closed) return;
    const seq = this.#seq++;
    this.#buffer.push({ seq, payload });
    if (this.#buffer.length > this.#max) this.#buffer.shift();
    this.stats.batches++;
    this.#enqueue(() => this.#pub.send([this.#topic, seqFrame(seq), payload]));
  }

  #enqueue(send: () => Promise<void>): void {
    // A send that fails (socket closing) loses that batch only: consumers see the gap.
    this.#chain = this.#chain.then(send).catch(() => {});
  }

  async #serveReplay(router: zmq.Router): Promise<void> {
    for (;;) {
      let frames: Buffer[];
      try {
        frames = await router.receive();
      } catch {
        return; // closed
      }
      const [id, delim, start] = frames;
      if (frames.length !== 3 || delim.length !== 0 || start.length !== 8) {
        this.stats.badReplays++;
        continue;
      }
      this.stats.replays++;
      const from = start.readBigUInt64BE();
      // A snapshot: batches published meanwhile go live, and a consumer orders them by seq.
      const kept = this.#buffer.filter((b) => b.seq >= from);
      try {
        for (const b of kept) await router.send([id, Buffer.alloc(0), this.#topic, seqFrame(b.seq), b.payload]);
        await router.send([id, Buffer.alloc(0), Buffer.alloc(0), END_SEQ, Buffer.alloc(0)]);
      } catch {
        if (this.#closed) return; // else that peer's reply is lost: it asks again
      }
    }
  }

  /** Sends what is queued, then closes both sockets. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#chain;
    this.#pub.close();
    this.#router?.close();
  }
}
