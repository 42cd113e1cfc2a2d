// The buffers a GGUF worker moves sequence states through (megabytes each:
// 8 KiB a token for the bench's model), used again from one request to the
// next. A fresh buffer of 10 MiB costs its first touch of every page: 4-5 ms
// to fill one with a copy where a buffer used before takes 0.4 ms (measured
// on the 2-core bench machine), on each of a prefill's read of its saved
// state and a decode's copy of the state out of its blocks.
//
// A buffer is lent to one holder at a time: `take` hands it out, `give`
// takes it back once nothing reads it any more (the prefill: its state
// copied into the blocks; the decode: llama.cpp loaded the file written from
// it). A buffer never given back is only garbage; one given back is never
// read again by whoever gave it (a state sealed after that would seal
// another request's bytes), which is why the only holders are the few
// functions of envelope.ts, kv.ts and turn.ts that say so.

/** Capacities are rounded up to this, so states a few tokens apart share buffers. */
const GRAIN = 1 << 20;

export class StateBuffers {
  /** Free buffers, smallest first. */
  readonly #free: Buffer[] = [];
  /** The buffers lent now: only these are taken back, each once (weakly: one never given back is garbage). */
  readonly #lent = new WeakSet<ArrayBufferLike>();
  #out = 0;

  /** `keep`: buffers kept for reuse at most (a worker's contexts: states in flight at once). */
  constructor(readonly keep: number) {}

  /** Buffers lent and not given back (tests: every path that should give back does). */
  get lent(): number {
    return this.#out;
  }

  /** A buffer of exactly `bytes` (its contents are whatever was there). */
  take(bytes: number): Buffer {
    const i = this.#free.findIndex((b) => b.length >= bytes);
    let whole: Buffer;
    if (i >= 0) whole = this.#free.splice(i, 1)[0];
    else {
      // None big enough: a new one, and the smallest free one goes, so that no more than `keep` are kept.
      if (this.#free.length >= this.keep) this.#free.shift();
      whole = Buffer.allocUnsafeSlow(Math.ceil(Math.max(bytes, 1) / GRAIN) * GRAIN);
    }
    this.#lent.add(whole.buffer);
    this.#out++;
    return whole.subarray(0, bytes);
  }

  /** Takes back a buffer `take` lent (its holder reads it no more); anything else, or a second time, is ignored. */
  give(b: Buffer): void {
    if (b.byteOffset !== 0 || !this.#lent.delete(b.buffer)) return;
    this.#out--;
    if (this.#free.length >= this.keep) return;
    this.#free.push(Buffer.from(b.buffer, 0, b.buffer.byteLength));
    this.#free.sort((x, y) => x.length - y.length);
  }
}
