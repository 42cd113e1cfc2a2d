// A binary min-heap on `at`: expiry queues, and heaviest-first (at = -weight)
// with stale entries skipped by their owner.

/** A binary min-heap on `at`. @internal */
export class MinHeap<T extends { at: number }> {
  #a: T[] = [];
  get size(): number {
    return this.#a.length;
  }
  clear(): void {
    this.#a = [];
  }
  peek(): T | undefined {
    return this.#a[0];
  }
  push(x: T): void {
    const a = this.#a;
    a.push(x);
    for (let i = a.length - 1; i > 0; ) {
      const p = (i - 1) >> 1;
      if (a[p].at <= a[i].at) break;
      [a[p], a[i]] = [a[i], a[p]];
      i = p;
    }
  }
  pop(): T | undefined {
    const a = this.#a;
    const top = a[0];
    const last = a.pop();
    if (a.length && last) {
      a[0] = last;
      for (let i = 0; ; ) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < a.length && a[l].at < a[m].at) m = l;
        if (r < a.length && a[r].at < a[m].at) m = r;
        if (m === i) break;
        [a[m], a[i]] = [a[i], a[m]];
        i = m;
      }
    }
    return top;
  }
}
