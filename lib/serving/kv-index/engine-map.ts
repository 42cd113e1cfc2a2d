// A worker's engine hash (unsigned 64-bit) -> the index's own key (53-bit),
// in insertion order for the index's bound. A Map<bigint, number> kept one
// BigInt key and one heap number value alive per block indexed (two heap
// objects each: 640,000 blocks are 1.3 M objects every scavenge copies and
// promotes), a quarter of the update rate's CPU time in the collector.
// Here keys and values are int32 halves in one typed array; a record's
// fields sit side by side, as in OrderedIntMap.
//
// A hash may have parts (0, 1, ...): entries of their own under the hash
// with a mask on its halves, for a block that stands for several of the
// index's keys (a worker whose block size is a multiple of the proxy's).
// A part's entry is another key in the same table, under the same bound.

const NONE = -1;
const MIX = (Math.floor(Math.random() * 0x7fffffff) * 2 + 1) | 0;
const KLO = 0;
const KHI = 1;
const VLO = 2;
const VHI = 3;
const PREV = 4;
const NEXT = 5;
const CHAIN = 6;
const STRIDE = 8;
/** A hash's halves through one 8-byte buffer: no BigInt made per split (`h & m`, `h >> 32n` make two). */
const H64 = new BigUint64Array(1);
const H32 = new Int32Array(H64.buffer);
const LITTLE = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const LO = LITTLE ? 0 : 1;
const HI = 1 - LO;

export class EngineMap {
  #r: Int32Array;
  #buckets: Int32Array;
  #cap = 8;
  #shift = 29;
  #head = NONE;
  #tail = NONE;
  #free = NONE;
  #used = 0;
  #size = 0;
  /** The halves of the hash last split (a lookup's key, without an array per call). */
  #lo = 0;
  #hi = 0;

  constructor() {
    this.#r = new Int32Array(this.#cap * STRIDE);
    this.#buckets = new Int32Array(this.#cap).fill(NONE);
  }

  get size(): number {
    return this.#size;
  }

  /** Splits `h` (its part's entry when `part` >= 0) into #lo, #hi; returns its bucket. */
  #split(h: bigint, part: number): number {
    H64[0] = h;
    this.#lo = H32[LO];
    this.#hi = H32[HI];
    if (part >= 0) {
      // Never zero for a part below 2^32: a part's entry is never its hash's own.
      this.#lo ^= Math.imul(part + 1, 0x9e3779b9);
      this.#hi ^= Math.imul(part + 1, 0x7f4a7c15);
    }
    return Math.imul(this.#lo ^ Math.imul(this.#hi, 0x85ebca6b), MIX) >>> this.#shift;
  }

  /** The record of the hash just split into bucket `b`, or NONE. */
  #find(b: number): number {
    const r = this.#r;
    let at = this.#buckets[b];
    while (at !== NONE && (r[at + KLO] !== this.#lo || r[at + KHI] !== this.#hi)) at = r[at + CHAIN];
    return at;
  }

  /** The key stored for `h` (for its part `part`), or -1 when none (keys are non-negative). */
  get(h: bigint, part = -1): number {
    const at = this.#find(this.#split(h, part));
    return at === NONE ? -1 : this.#r[at + VHI] * 0x100000000 + (this.#r[at + VLO] >>> 0);
  }

  /**
   * Sets `h` (its part `part`) to `key` (a 53-bit non-negative integer): in
   * place when present (`young`: moved to the young end), else as the youngest.
   */
  set(h: bigint, key: number, part = -1, young = false): void {
    let b = this.#split(h, part);
    let at = this.#find(b);
    if (at !== NONE && young && at !== this.#tail) {
      this.#unlink(at);
      this.#append(at);
    }
    if (at === NONE) {
      if (this.#free === NONE && this.#used === this.#cap) {
        this.#grow();
        b = this.#split(h, part);
      }
      at = this.#alloc();
      const r = this.#r;
      r[at + KLO] = this.#lo;
      r[at + KHI] = this.#hi;
      r[at + CHAIN] = this.#buckets[b];
      this.#buckets[b] = at;
      this.#append(at);
      this.#size++;
    }
    this.#r[at + VLO] = key | 0;
    this.#r[at + VHI] = Math.floor(key / 0x100000000);
  }

  /** Forgets `h` (its part `part`); whether it was there. */
  delete(h: bigint, part = -1): boolean {
    return this.#remove(this.#split(h, part));
  }

  /** Forgets the `n` oldest entries. */
  dropOldest(n: number): void {
    const r = this.#r;
    for (; n > 0 && this.#size > 0; n--) {
      const at = this.#head;
      this.#lo = r[at + KLO];
      this.#hi = r[at + KHI];
      this.#remove(Math.imul(this.#lo ^ Math.imul(this.#hi, 0x85ebca6b), MIX) >>> this.#shift);
    }
  }

  /** Removes the record of the hash just split into bucket `b`. */
  #remove(b: number): boolean {
    const r = this.#r;
    let prev = NONE;
    let at = this.#buckets[b];
    while (at !== NONE && (r[at + KLO] !== this.#lo || r[at + KHI] !== this.#hi)) {
      prev = at;
      at = r[at + CHAIN];
    }
    if (at === NONE) return false;
    if (prev === NONE) this.#buckets[b] = r[at + CHAIN];
    else r[prev + CHAIN] = r[at + CHAIN];
    this.#unlink(at);
    r[at + CHAIN] = this.#free;
    this.#free = at;
    this.#size--;
    return true;
  }

  /** Takes record `at` out of the age list. */
  #unlink(at: number): void {
    const r = this.#r;
    const p = r[at + PREV];
    const n = r[at + NEXT];
    if (p !== NONE) r[p + NEXT] = n;
    else this.#head = n;
    if (n !== NONE) r[n + PREV] = p;
    else this.#tail = p;
  }

  /** Puts record `at` at the age list's young end. */
  #append(at: number): void {
    const r = this.#r;
    r[at + PREV] = this.#tail;
    r[at + NEXT] = NONE;
    if (this.#tail !== NONE) r[this.#tail + NEXT] = at;
    else this.#head = at;
    this.#tail = at;
  }

  #alloc(): number {
    if (this.#free === NONE) return this.#used++ * STRIDE;
    const at = this.#free;
    this.#free = this.#r[at + CHAIN];
    return at;
  }

  /** Doubles the records (all in use) and rebuilds the buckets. */
  #grow(): void {
    this.#cap *= 2;
    this.#shift--;
    const r = new Int32Array(this.#cap * STRIDE);
    r.set(this.#r);
    this.#r = r;
    this.#buckets = new Int32Array(this.#cap).fill(NONE);
    for (let at = 0; at < this.#used * STRIDE; at += STRIDE) {
      const b = Math.imul(r[at + KLO] ^ Math.imul(r[at + KHI], 0x85ebca6b), MIX) >>> this.#shift;
      r[at + CHAIN] = this.#buckets[b];
      this.#buckets[b] = at;
    }
  }
}
