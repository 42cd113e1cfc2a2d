// Blocks a push decode gave up on. A prefill may still WRITE into a block
// the decode registered, after the decode stopped waiting (vLLM's push
// prefill sends nothing on failure and may post a deferred WRITE late), so
// such a block is not handed out again until the prefill's lease on the
// request is over: its WRITE can no longer be posted, and one in flight has
// ended with the lease. Reusing it earlier is the push form of the stale-KV
// bug: another request's KV overwritten with HTTP 200.

/** A block given up on, and until when (performance.now() ms) it stays out of use. */
export interface Quarantined {
  blockId: number;
  untilMs: number;
  requestId: string;
}

/** Local blocks out of use until a time; each release is announced. */
export class BlockQuarantine {
  readonly #until = new Map<number, Quarantined>();
  readonly #now: () => number;
  readonly #waiters = new Set<() => void>();
  #timer: NodeJS.Timeout | undefined;

  constructor(now: () => number = () => performance.now()) {
    this.#now = now;
  }

  /** Puts blocks out of use until `untilMs` (a later time wins for a block already held). */
  add(requestId: string, blockIds: readonly number[], untilMs: number): void {
    for (const b of blockIds) {
      const had = this.#until.get(b);
      if (!had || had.untilMs < untilMs) this.#until.set(b, { blockId: b, untilMs, requestId });
    }
    this.#arm();
  }

  /** Whether a block is still out of use (expired entries are dropped as they are seen). */
  has(blockId: number): boolean {
    const q = this.#until.get(blockId);
    if (!q) return false;
    if (q.untilMs > this.#now()) return true;
    this.#until.delete(blockId);
    return false;
  }

  /** The blocks of `ids` still out of use. */
  held(ids: readonly number[]): number[] {
    return ids.filter((b) => this.has(b));
  }

  /** Until when a block stays out of use; undefined when it is usable. */
  until(blockId: number): number | undefined {
    return this.has(blockId) ? this.#until.get(blockId)!.untilMs : undefined;
  }

  /** Blocks out of use now. */
  get size(): number {
    this.#sweep();
    return this.#until.size;
  }

  /** Everything out of use now. */
  list(): Quarantined[] {
    this.#sweep();
    return [...this.#until.values()];
  }

  /** Resolves once no block is out of use. */
  drained(): Promise<void> {
    if (this.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.#waiters.add(resolve));
  }

  #sweep(): void {
    const now = this.#now();
    for (const [b, q] of this.#until) if (q.untilMs <= now) this.#until.delete(b);
    if (this.#until.size === 0) {
      for (const w of this.#waiters) w();
      this.#waiters.clear();
    }
  }

  #arm(): void {
    clearTimeout(this.#timer);
    if (this.#until.size === 0) return;
    const next = Math.min(...[...this.#until.values()].map((q) => q.untilMs));
    this.#timer = setTimeout(
      () => {
        this.#sweep();
        this.#arm();
      },
      Math.max(1, next - this.#now()),
    );
    this.#timer.unref();
  }

  /** Stops the timer (the entries stay: close does not make blocks safe). */
  close(): void {
    clearTimeout(this.#timer);
  }
}
