// One publisher's event stream as a state machine, without sockets (the
// subscriber in subscriber.ts feeds it): sequence tracking, replay on
// connect and on a gap with live messages held back until the replay is
// applied, a sequence that goes backwards (the worker restarted) clears the
// worker's index, and a replay that can no longer cover a gap is a counted
// loss: the worker's index is cleared and rebuilt from the first batch
// still available (docs/kv-events.md, spec §7 and §10).

/** What the stream does to the outside: apply a batch, clear the worker's index, ask for a replay, count. */
export interface StreamSink {
  apply(seq: bigint, payload: Uint8Array): void;
  clear(): void;
  /** Ask the publisher for batches from `start`; false when it has no replay endpoint. */
  replay(start: bigint): boolean;
  count(what: 'gaps' | 'replays' | 'restarts' | 'replay_lost' | 'duplicates' | 'held_overflow'): void;
}

/** Live messages held back during a replay, at most (past it, they are dropped and the loss handled at its end). */
export const MAX_HELD = 4096;

export class EventStream {
  /** The last applied sequence number; -1: none yet. */
  last = -1n;
  #replaying = false;
  #from = 0n;
  #sawReplay = false;
  readonly #held = new Map<bigint, Uint8Array>();

  constructor(readonly sink: StreamSink) {}

  get replaying(): boolean {
    return this.#replaying;
  }

  /** The subscription just connected: rebuild from the publisher's buffer. */
  connected(): void {
    this.#startReplay(0n);
  }

  #startReplay(from: bigint): void {
    if (!this.sink.replay(from)) return;
    this.sink.count('replays');
    this.#replaying = true;
    this.#from = from;
    this.#sawReplay = false;
  }

  #applyNext(seq: bigint, payload: Uint8Array): void {
    this.last = seq;
    this.sink.apply(seq, payload);
  }

  /** A batch is missing between last and `seq` and cannot be had: count it, forget the worker, go on from `seq`. */
  #lose(seq: bigint, payload: Uint8Array): void {
    this.sink.count('replay_lost');
    this.sink.clear();
    this.#applyNext(seq, payload);
  }

  live(seq: bigint, payload: Uint8Array): void {
    if (this.#replaying) {
      if (this.#held.size >= MAX_HELD) this.sink.count('held_overflow');
      else this.#held.set(seq, payload);
      return;
    }
    if (this.last >= 0n && seq < this.last) {
      // A new incarnation of the publisher (it restarted from 0).
      this.sink.count('restarts');
      this.sink.clear();
      this.last = -1n;
      if (seq === 0n) {
        this.#applyNext(seq, payload);
        return;
      }
      this.#held.set(seq, payload);
      this.sink.count('gaps');
      this.#startReplay(0n);
      if (!this.#replaying) this.#flush();
      return;
    }
    if (seq <= this.last) {
      this.sink.count('duplicates');
      return;
    }
    if (seq === this.last + 1n) {
      this.#applyNext(seq, payload);
      return;
    }
    // A gap (also a first message after 0 that no replay preceded).
    this.sink.count('gaps');
    this.#held.set(seq, payload);
    this.#startReplay(this.last + 1n);
    if (!this.#replaying) this.#flush();
  }

  /** One replayed batch (in order). */
  replayed(seq: bigint, payload: Uint8Array): void {
    if (!this.#replaying) return;
    if (!this.#sawReplay) {
      this.#sawReplay = true;
      // The publisher's buffer no longer starts where we asked: what lies between is lost.
      if (seq > this.#from && seq > this.last + 1n) {
        this.#lose(seq, payload);
        return;
      }
    }
    if (seq <= this.last) return;
    if (seq === this.last + 1n || this.last < 0n) {
      this.#applyNext(seq, payload);
      return;
    }
    this.#lose(seq, payload);
  }

  /** The replay ended (end marker, or no answer in time): apply the held live messages in order. */
  replayEnded(): void {
    if (!this.#replaying) return;
    this.#replaying = false;
    this.#flush();
  }

  #flush(): void {
    const seqs = [...this.#held.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    for (const s of seqs) {
      const p = this.#held.get(s)!;
      if (s <= this.last) this.sink.count('duplicates');
      else if (s === this.last + 1n || (this.last < 0n && s === 0n)) this.#applyNext(s, p);
      else this.#lose(s, p);
    }
    this.#held.clear();
  }
}
