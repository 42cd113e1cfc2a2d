// An insertion-ordered int32 -> int32 map in typed arrays, for the block
// index's per-worker maps (what a worker holds, its speculative entries).
// Those are trimmed from their oldest end on the routing decision's path,
// and a V8 Map there was the decision's tail: deleting from its front leaves
// holes that each later walk from the front steps over again, and once the
// holes fill its table it rehashes every entry (10,000 speculative entries
// a worker: one decision in a hundred took 100-500 us more). Here every
// operation is O(1) (a short bucket chain aside): entries are records in a
// doubly linked list (oldest first) and a bucket chain, freed records are
// reused, and the table only grows (to the most entries held at once, which
// the index bounds), never rehashes otherwise. Nothing is allocated per
// operation.

const NONE = -1;
/** An odd multiplier per process: bucket chains that input chooses cannot be built offline. */
const MIX = (Math.floor(Math.random() * 0x7fffffff) * 2 + 1) | 0;
/**
 * A record's fields, side by side in one array (a lookup or a trim touches
 * one record's fields together: one cache line, not five arrays' worth).
 */
const KEY = 0;
const VAL = 1;
/** Order links: the older and younger record, NONE at the ends. */
const PREV = 2;
const NEXT = 3;
/** The bucket's next record; for a free record, the next free one. */
const CHAIN = 4;
const STRIDE = 5;

export class OrderedIntMap {
  /** Records (record r at r * STRIDE). */
  #r: Int32Array;
  #buckets: Int32Array;
  #cap: number;
  #shift: number;
  #head = NONE;
  #tail = NONE;
  #free = NONE;
  #used = 0;
  #size = 0;

  constructor(capacity = 8) {
    let cap = 8;
    while (cap < capacity) cap *= 2;
    this.#cap = cap;
    this.#r = new Int32Array(cap * STRIDE);
    this.#buckets = new Int32Array(cap).fill(NONE);
    this.#shift = 32 - Math.log2(cap);
  }

  get size(): number {
    return this.#size;
  }

  #bucket(k: number): number {
    return Math.imul(k, MIX) >>> this.#shift;
  }

  /** The record holding `k` (its offset in #r), or NONE. */
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

  /** Sets `k` to `v`: in place (its age kept) when present, else as the youngest. */
  set(k: number, v: number): void {
    const at = this.#find(k);
    if (at !== NONE) this.#r[at + VAL] = v;
    else this.#append(k, v);
  }

  /** Sets `k` to `v` as the youngest entry (a Map's delete then set). */
  setYoungest(k: number, v: number): void {
    const at = this.#find(k);
    if (at === NONE) {
      this.#append(k, v);
      return;
    }
    this.#r[at + VAL] = v;
    if (at === this.#tail) return;
    this.#unlinkOrder(at);
    this.#linkTail(at);
  }

  /** Forgets `k`; whether it was there. */
  delete(k: number): boolean {
    const r = this.#r;
    const b = this.#bucket(k);
    let prev = NONE;
    let at = this.#buckets[b];
    while (at !== NONE && r[at + KEY] !== k) {
      prev = at;
      at = r[at + CHAIN];
    }
    if (at === NONE) return false;
    if (prev === NONE) this.#buckets[b] = r[at + CHAIN];
    else r[prev + CHAIN] = r[at + CHAIN];
    this.#unlinkOrder(at);
    r[at + CHAIN] = this.#free;
    this.#free = at;
    this.#size--;
    return true;
  }

  /** The oldest record (NONE when empty); walk on with younger(). */
  oldest(): number {
    return this.#head;
  }

  younger(at: number): number {
    return this.#r[at + NEXT];
  }

  keyAt(at: number): number {
    return this.#r[at + KEY];
  }

  valueAt(at: number): number {
    return this.#r[at + VAL];
  }

  /** Entries, oldest first (for tests and checks). */
  *entries(): Generator<[number, number]> {
    for (let at = this.#head; at !== NONE; at = this.#r[at + NEXT]) yield [this.#r[at + KEY], this.#r[at + VAL]];
  }

  *keys(): Generator<number> {
    for (let at = this.#head; at !== NONE; at = this.#r[at + NEXT]) yield this.#r[at + KEY];
  }

  #append(k: number, v: number): void {
    if (this.#free === NONE && this.#used === this.#cap) this.#grow();
    let at: number;
    if (this.#free !== NONE) {
      at = this.#free;
      this.#free = this.#r[at + CHAIN];
    } else at = this.#used++ * STRIDE;
    const r = this.#r;
    const b = this.#bucket(k);
    r[at + KEY] = k;
    r[at + VAL] = v;
    r[at + CHAIN] = this.#buckets[b];
    this.#buckets[b] = at;
    this.#linkTail(at);
    this.#size++;
  }

  #linkTail(at: number): void {
    const r = this.#r;
    r[at + PREV] = this.#tail;
    r[at + NEXT] = NONE;
    if (this.#tail !== NONE) r[this.#tail + NEXT] = at;
    else this.#head = at;
    this.#tail = at;
  }

  #unlinkOrder(at: number): void {
    const r = this.#r;
    const p = r[at + PREV];
    const n = r[at + NEXT];
    if (p !== NONE) r[p + NEXT] = n;
    else this.#head = n;
    if (n !== NONE) r[n + PREV] = p;
    else this.#tail = p;
  }

  /** Doubles the records (all in use, none free) and rebuilds the buckets. */
  #grow(): void {
    this.#cap *= 2;
    const r = new Int32Array(this.#cap * STRIDE);
    r.set(this.#r);
    this.#r = r;
    this.#buckets = new Int32Array(this.#cap).fill(NONE);
    this.#shift--;
    for (let at = 0; at < this.#used * STRIDE; at += STRIDE) {
      const b = this.#bucket(r[at + KEY]);
      r[at + CHAIN] = this.#buckets[b];
      this.#buckets[b] = at;
    }
  }
}
