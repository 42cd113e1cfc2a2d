// A worker's KV cache blocks: a free list. A request takes the blocks it
// needs or fails at once (the cache is full), and gives them back when the
// decode side has read them or the lease ran out.
export class BlockPool {
  readonly #free: number[];

  constructor(readonly size: number) {
    this.#free = Array.from({ length: size }, (_, i) => size - 1 - i);
  }

  get available(): number {
    return this.#free.length;
  }

  /** n block ids, or undefined when fewer are free. */
  take(n: number): number[] | undefined {
    if (n > this.#free.length) return undefined;
    return this.#free.splice(this.#free.length - n, n).reverse();
  }

  give(ids: readonly number[]): void {
    for (const id of ids) this.#free.push(id);
  }
}
