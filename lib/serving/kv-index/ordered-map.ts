// An insertion-ordered int32 -> int32 map in typed arrays, for the block
// index's per-worker maps (what a worker holds, its speculative entries).
// Those are trimmed from their oldest end on the routing decision's path,
// and a V8 Map there was the decision's tail: deleting from its front leaves
// holes that each later walk from the front steps over again, and once the
// holes fill its table it rehashes every entry (10,000 speculative entries
// a worker: one decision in a hundred took 100-500 us more).
//
// Records sit in a ring in insertion order (key, value, bucket chain), so
// appending and trimming the oldest walk memory in order (the CPU prefetches
// them; a linked list's next record is a miss that waits on the last one),
// and a bucket chain over them finds a key. A record deleted out of order
// (or moved to the young end: deleted, then appended) is marked dead and
// skipped when the oldest end reaches it. The ring grows only when live and
// dead records fill it: to twice the size, or the same size without the
// dead ones when they are half of it. Nothing is allocated per operation.

const NONE = -1;
/** The value of a dead record (live values are non-negative). */
const DEAD = -1;
/** An odd multiplier per process: bucket chains that input chooses cannot be built offline. */
const MIX = (Math.floor(Math.random() * 0x7fffffff) * 2 + 1) | 0;
const KEY = 0;
const VAL = 1;
/** The bucket's next record (its offset), or NONE. */
const CHAIN = 2;
const STRIDE = 3;

export class OrderedIntMap {
  /** The ring of records: record p (a position, counted from the start) at (p & mask) * STRIDE. */
  #r: Int32Array;
  #buckets: Int32Array;
  #mask: number;
  #shift: number;
  /** Positions of the oldest record and the next one appended (live and dead between). */
  #head = 0;
  #tail = 0;
  #size = 0;
  #dead = 0;

  constructor(capacity = 8) {
    let cap = 8;
    while (cap < capacity) cap *= 2;
    this.#r = new Int32Array(cap * STRIDE);
    this.#buckets = new Int32Array(cap).fill(NONE);
    this.#mask = cap - 1;
    this.#shift = 32 - Math.log2(cap);
  }

  get size(): number {
    return this.#size;
  }

  /** Records the ring holds, live and dead: what the map's memory is (16 bytes a record with its bucket). */
  get capacity(): number {
    return this.#mask + 1;
  }

  #bucket(k: number): number {
    return Math.imul(k, MIX) >>> this.#shift;
  }

  /** The record holding `k` (its offset), or NONE. */
  #find(k: number): number {
    const r = this.#r;
    let at = this.#buckets[this.#bucket(k)];
    while (at !== NONE && r[at + KEY] !== k) at = r[at + CHAIN];
    return at;
  }

  /** The value of `k`, or -1 when absent (values are non-negative). */
  get(k: number): number {
    const at = this.#find(k);
    return at === NONE ? -1 : this.#r[at + VAL];
  }

  has(k: number): boolean {
    return this.#find(k) !== NONE;
  }

  /** Sets `k` to `v` (non-negative): in place (its age kept) when present, else as the youngest. */
  set(k: number, v: number): void {
    const at = this.#find(k);
    if (at !== NONE) this.#r[at + VAL] = v;
    else this.#append(k, v);
  }

  /** Sets `k` to `v` as the youngest entry (a Map's delete then set). */
  setYoungest(k: number, v: number): void {
    const last = ((this.#tail - 1) & this.#mask) * STRIDE;
    if (this.#tail > this.#head && this.#r[last + KEY] === k && this.#r[last + VAL] !== DEAD) {
      this.#r[last + VAL] = v;
      return;
    }
    this.delete(k);
    this.#append(k, v);
  }

  /** Forgets `k`; whether it was there. */
  delete(k: number): boolean {
    const at = this.#unchain(k);
    if (at === NONE) return false;
    this.#r[at + VAL] = DEAD;
    this.#size--;
    this.#dead++;
    this.#dropDeadHead();
    return true;
  }

  /**
   * Forgets the oldest entry and returns its record, whose keyAt() and
   * valueAt() hold until the next change; NONE when empty.
   */
  popOldest(): number {
    if (this.#size === 0) return NONE;
    const r = this.#r;
    const at = (this.#head & this.#mask) * STRIDE;
    this.#unchain(r[at + KEY]);
    this.#head++;
    this.#size--;
    this.#dropDeadHead();
    return at;
  }

  keyAt(at: number): number {
    return this.#r[at + KEY];
  }

  valueAt(at: number): number {
    return this.#r[at + VAL];
  }

  /** Entries, oldest first. */
  *entries(): Generator<[number, number]> {
    for (let p = this.#head; p < this.#tail; p++) {
      const at = (p & this.#mask) * STRIDE;
      if (this.#r[at + VAL] !== DEAD) yield [this.#r[at + KEY], this.#r[at + VAL]];
    }
  }

  *keys(): Generator<number> {
    for (const [k] of this.entries()) yield k;
  }

  /** Takes `k`'s record out of its bucket chain; its offset, or NONE. */
  #unchain(k: number): number {
    const r = this.#r;
    const b = this.#bucket(k);
    let prev = NONE;
    let at = this.#buckets[b];
    while (at !== NONE && r[at + KEY] !== k) {
      prev = at;
      at = r[at + CHAIN];
    }
    if (at === NONE) return NONE;
    if (prev === NONE) this.#buckets[b] = r[at + CHAIN];
    else r[prev + CHAIN] = r[at + CHAIN];
    return at;
  }

  /** Moves the oldest end past dead records. */
  #dropDeadHead(): void {
    while (this.#head < this.#tail && this.#r[(this.#head & this.#mask) * STRIDE + VAL] === DEAD) {
      this.#head++;
      this.#dead--;
    }
  }

  #append(k: number, v: number): void {
    if (this.#tail - this.#head > this.#mask) this.#relayout();
    else if (this.#head > this.#mask) {
      // Positions stay small integers: both ends back by the ring's size, the same records.
      this.#head -= this.#mask + 1;
      this.#tail -= this.#mask + 1;
    }
    const r = this.#r;
    const at = (this.#tail & this.#mask) * STRIDE;
    const b = this.#bucket(k);
    r[at + KEY] = k;
    r[at + VAL] = v;
    r[at + CHAIN] = this.#buckets[b];
    this.#buckets[b] = at;
    this.#tail++;
    this.#size++;
  }

  /** The ring is full: lays the live records out again in order, in a ring twice the size unless half were dead. */
  #relayout(): void {
    const old = this.#r;
    const oldMask = this.#mask;
    const cap = this.#dead * 2 >= oldMask + 1 ? oldMask + 1 : (oldMask + 1) * 2;
    const r = cap === oldMask + 1 ? new Int32Array(old.length) : new Int32Array(cap * STRIDE);
    this.#buckets = new Int32Array(cap).fill(NONE);
    this.#mask = cap - 1;
    this.#shift = 32 - Math.log2(cap);
    let at = 0;
    for (let p = this.#head; p < this.#tail; p++) {
      const from = (p & oldMask) * STRIDE;
      if (old[from + VAL] === DEAD) continue;
      const b = this.#bucket(old[from + KEY]);
      r[at + KEY] = old[from + KEY];
      r[at + VAL] = old[from + VAL];
      r[at + CHAIN] = this.#buckets[b];
      this.#buckets[b] = at;
      at += STRIDE;
    }
    this.#r = r;
    this.#head = 0;
    this.#tail = this.#size;
    this.#dead = 0;
  }
}
