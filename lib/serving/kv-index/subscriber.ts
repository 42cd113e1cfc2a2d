// The sockets of one worker's KV events: SUB on its publisher (frames
// [topic, seq u64 BE, payload]) and DEALER on its replay endpoint
// ([b"", start] out; [seq, payload] or [topic, seq, payload] back, ended by
// seq 2^64-1 or an empty payload). The EventStream decides what to apply.
import * as zmq from 'zeromq';
import { EventStream, type StreamSink } from './stream';

/** Where a worker publishes: its PUB address and, optionally, its replay (ROUTER) address. */
export interface EventEndpoint {
  pub: string;
  replay?: string;
  /**
   * Take only messages of this topic (vLLM's `topic`; llm-d's convention
   * kv@<pod-ip>:<port>@<model>): one PUB may carry several workers' streams
   * (a collector the workers connect to). Unset or '': every message.
   */
  topic?: string;
}

const END = (1n << 64n) - 1n;
/** Largest message accepted from a publisher (bytes); larger ones are cut by ZeroMQ. */
const MAX_MESSAGE = 16 << 20;
/** A replay that does not end within this is taken as ended. */
const REPLAY_TIMEOUT_MS = 3000;
/** Messages handled before the loop yields to the event loop, so a flood cannot stall routing. */
const YIELD_EVERY = 256;

function seqOf(frame: Buffer | undefined): bigint | undefined {
  return frame?.length === 8 ? frame.readBigUInt64BE(0) : undefined;
}

export class EventSubscriber {
  readonly stream: EventStream;
  readonly #sub = new zmq.Subscriber({ maxMessageSize: MAX_MESSAGE, receiveHighWaterMark: 100_000 });
  #dealer?: zmq.Dealer;
  #closed = false;
  /** A replay request is unanswered. */
  #open = false;
  /** Replays given up on (timed out) whose replies may still come. */
  #stale = 0;
  #timer?: NodeJS.Timeout;
  readonly #topic?: Buffer;

  constructor(
    readonly endpoint: EventEndpoint,
    sink: Omit<StreamSink, 'replay'>,
    readonly onMalformed: () => void,
  ) {
    this.stream = new EventStream({ ...sink, replay: (start) => this.#replay(start) });
    if (endpoint.topic) this.#topic = Buffer.from(endpoint.topic);
  }

  start(): void {
    // ZeroMQ filters by prefix; the live loop then keeps the exact topic only.
    if (this.endpoint.topic) this.#sub.subscribe(this.endpoint.topic);
    else this.#sub.subscribe();
    this.#sub.connect(this.endpoint.pub);
    if (this.endpoint.replay) {
      this.#dealer = new zmq.Dealer({ maxMessageSize: MAX_MESSAGE, linger: 0 });
      this.#dealer.connect(this.endpoint.replay);
      void this.#replayLoop(this.#dealer);
    }
    void this.#liveLoop();
    this.stream.connected();
  }

  async #liveLoop(): Promise<void> {
    let n = 0;
    try {
      for await (const frames of this.#sub) {
        if (this.#closed) break;
        const seq = seqOf(frames[1]);
        if (frames.length !== 3 || seq === undefined) this.onMalformed();
        else if (this.#topic === undefined || frames[0].equals(this.#topic)) this.stream.live(seq, frames[2]);
        if (++n % YIELD_EVERY === 0) await new Promise((r) => setImmediate(r));
      }
    } catch {
      // closed
    }
  }

  #replay(start: bigint): boolean {
    const d = this.#dealer;
    if (!d || this.#closed) return false;
    // A request still unanswered: its replies and end marker come first, and are skipped.
    if (this.#open) this.#stale++;
    this.#open = true;
    const req = Buffer.alloc(8);
    req.writeBigUInt64BE(start);
    d.send([Buffer.alloc(0), req]).catch(() => this.#ended());
    clearTimeout(this.#timer);
    this.#timer = setTimeout(() => {
      // Its replies may still come: skip them when they do.
      this.#stale++;
      this.#ended();
    }, REPLAY_TIMEOUT_MS);
    this.#timer.unref();
    return true;
  }

  #ended(): void {
    clearTimeout(this.#timer);
    if (!this.#open) return;
    this.#open = false;
    if (!this.#closed) this.stream.replayEnded();
  }

  async #replayLoop(d: zmq.Dealer): Promise<void> {
    try {
      for await (const frames of d) {
        if (this.#closed) break;
        // After the empty delimiter: [seq, payload] (vLLM < 0.26) or [topic, seq, payload].
        const rest = frames[0]?.length === 0 ? frames.slice(1) : frames;
        const tail = rest.length === 3 ? rest.slice(1) : rest;
        const seq = seqOf(tail[0]);
        if (tail.length !== 2 || seq === undefined) {
          this.onMalformed();
          continue;
        }
        const end = seq === END || tail[1].length === 0;
        if (this.#stale > 0) {
          if (end) this.#stale--;
          continue;
        }
        if (!this.#open) continue;
        if (end) this.#ended();
        else this.stream.replayed(seq, tail[1]);
      }
    } catch {
      // closed
    }
  }

  close(): void {
    this.#closed = true;
    clearTimeout(this.#timer);
    this.#sub.close();
    this.#dealer?.close();
  }
}
