// The inverted side of the block index: slot -> the workers holding it, so a
// routing decision looks each of the prompt's blocks up once, whatever the
// number of workers, instead of once in every worker's map.
//
// A slot's holders are a linked list of records in typed arrays (worker id,
// payload, next), the map holding the first record's index: map values stay
// small integers and an update allocates nothing. A number over 31 bits as
// a map value, or an array a slot, would be a heap object per block, and
// the garbage is the index's update rate and the decision's tail.

const NONE = -1;

/** Slot -> the (worker id, payload) records of the workers holding it, mirroring their own maps. */
export class Holders {
  readonly map = new Map<number, number>();
  /** By record: the worker id; the free records' chain runs through `next`. */
  id = new Int32Array(1024);
  /** By record: what the worker's own map holds for the slot (an int32). */
  payload = new Int32Array(1024);
  /** By record: the slot's next record, or -1. */
  next = new Int32Array(1024);
  #free = NONE;
  #used = 0;
  /** Records in use: one per (slot, worker). */
  #live = 0;

  get size(): number {
    return this.#live;
  }

  #alloc(): number {
    if (this.#free !== NONE) {
      const r = this.#free;
      this.#free = this.next[r];
      return r;
    }
    if (this.#used === this.id.length) {
      const grow = (a: Int32Array) => {
        const b = new Int32Array(a.length * 2);
        b.set(a);
        return b;
      };
      this.id = grow(this.id);
      this.payload = grow(this.payload);
      this.next = grow(this.next);
    }
    return this.#used++;
  }

  /** Records that worker `id` holds `slot` with `payload` (replacing what it held there). */
  set(slot: number, id: number, payload: number): void {
    const head = this.map.get(slot);
    if (head !== undefined)
      for (let r = head; r !== NONE; r = this.next[r])
        if (this.id[r] === id) {
          this.payload[r] = payload;
          return;
        }
    const r = this.#alloc();
    this.id[r] = id;
    this.payload[r] = payload;
    this.next[r] = head ?? NONE;
    this.map.set(slot, r);
    this.#live++;
  }

  /** Forgets worker `id`'s record for `slot`, if any. */
  delete(slot: number, id: number): void {
    const head = this.map.get(slot);
    if (head === undefined) return;
    for (let prev = NONE, r = head; r !== NONE; prev = r, r = this.next[r]) {
      if (this.id[r] !== id) continue;
      const after = this.next[r];
      if (prev !== NONE) this.next[prev] = after;
      else if (after === NONE) this.map.delete(slot);
      else this.map.set(slot, after);
      this.next[r] = this.#free;
      this.#free = r;
      this.#live--;
      return;
    }
  }

  /** Every (slot, worker id, payload) held, for tests and checks. */
  *entries(): Generator<[number, number, number]> {
    for (const [slot, head] of this.map)
      for (let r = head; r !== NONE; r = this.next[r]) yield [slot, this.id[r], this.payload[r]];
  }
}
