// A worker's KV cache blocks: a free list, and a queue of the requests that
// wait for blocks (vLLM's scheduler keeps a request waiting while its cache is
// full for a moment; it never fails it for that). Waiters are served strictly
// in order: the head blocks later ones, so a big request is never starved by
// small ones. A waiter leaves at its deadline (503 with Retry-After) or when
// its client goes away; a request bigger than the whole cache is a 400 at once.
import { NixlError } from '../../errors';
import type { HttpError } from '../api/http';
import { failure } from '../api/errors';

/** How long a request may wait for blocks, and how many may wait. */
export interface BlockQueueOptions {
  /** Longest wait for blocks, ms (default 30 s; 0: a full cache refuses at once). */
  kvWaitMs?: number;
  /** Requests that may wait at once (default 1024); past it a 503 at once. */
  kvQueueMax?: number;
}

export const DEFAULT_KV_WAIT_MS = 30_000;
export const DEFAULT_KV_QUEUE_MAX = 1024;
/** The longest wait a Node.js timer takes (longer ones fire at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** Throws NIXL_ERR_INVALID_PARAM on out-of-range queue options (checked at start). */
export function checkBlockQueueOptions(o: BlockQueueOptions): void {
  const w = o.kvWaitMs;
  if (w !== undefined && !(Number.isSafeInteger(w) && w >= 0 && w <= MAX_TIMER_MS))
    throw new NixlError(
      `kvWaitMs must be a whole number of ms from 0 to ${MAX_TIMER_MS}, got ${w}`,
      'NIXL_ERR_INVALID_PARAM',
    );
  const q = o.kvQueueMax;
  if (q !== undefined && !(Number.isSafeInteger(q) && q >= 0))
    throw new NixlError(`kvQueueMax must be a count of requests, got ${q}`, 'NIXL_ERR_INVALID_PARAM');
}

/** A request whose KV cannot fit the cache even when empty: a 400 at once, never a wait. */
export function tooLarge(n: number, size: number): HttpError {
  return failure('kv_request_too_large', `the prompt's KV needs ${n} blocks; this worker's KV cache holds ${size}`);
}

interface Waiter {
  n: number;
  done(ids: number[] | undefined, e?: Error): void;
}

export class BlockPool {
  readonly #free: number[];
  readonly #waiters: Waiter[] = [];
  readonly #waitMs: number;
  readonly #queueMax: number;

  constructor(
    readonly size: number,
    o: BlockQueueOptions = {},
  ) {
    checkBlockQueueOptions(o);
    this.#free = Array.from({ length: size }, (_, i) => size - 1 - i);
    this.#waitMs = o.kvWaitMs ?? DEFAULT_KV_WAIT_MS;
    this.#queueMax = o.kvQueueMax ?? DEFAULT_KV_QUEUE_MAX;
  }

  get available(): number {
    return this.#free.length;
  }

  /** Requests waiting for blocks (vLLM's num_requests_waiting). */
  get waiting(): number {
    return this.#waiters.length;
  }

  /** n block ids now, or undefined when fewer are free or requests wait for blocks (they go first). */
  take(n: number): number[] | undefined {
    if (n > this.#free.length || this.#waiters.length > 0) return undefined;
    return this.#free.splice(this.#free.length - n, n).reverse();
  }

  /**
   * n block ids, once free and every request queued before is served. A 400
   * (kv_request_too_large) when the whole cache is smaller; a 503 with
   * Retry-After when the queue is full or the wait passes its deadline; a 499
   * when `signal` aborts first (its place goes to the next).
   */
  acquire(n: number, signal?: AbortSignal): Promise<number[]> {
    if (n > this.size) return Promise.reject(tooLarge(n, this.size));
    const now = this.take(n);
    if (now) return Promise.resolve(now);
    if (signal?.aborted) return Promise.reject(failure('aborted', 'the client went away'));
    if (this.#waitMs === 0)
      return Promise.reject(failure('kv_cache_full', `KV cache full: ${n} blocks wanted, ${this.available} free`));
    if (this.#waiters.length >= this.#queueMax)
      return Promise.reject(
        failure('kv_queue_full', `KV cache full and ${this.#waiters.length} requests already wait for blocks`),
      );
    return new Promise((resolve, reject) => {
      const t0 = performance.now();
      const w: Waiter = {
        n,
        done: (ids, e) => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
          if (ids) resolve(ids);
          else {
            this.#leave(w);
            reject(e);
          }
        },
      };
      const timer = setTimeout(() => {
        const ms = Math.round(performance.now() - t0);
        w.done(
          undefined,
          failure(
            'kv_cache_full',
            `KV cache full: ${n} blocks wanted, ${this.available} free after waiting ${ms} ms ` +
              `(${this.#waiters.length} requests waiting)`,
          ),
        );
      }, this.#waitMs);
      const onAbort = () => w.done(undefined, failure('aborted', 'the client went away'));
      signal?.addEventListener('abort', onAbort, { once: true });
      this.#waiters.push(w);
    });
  }

  give(ids: readonly number[]): void {
    for (const id of ids) this.#free.push(id);
    this.#serve();
  }

  /** Fails every waiter (the worker is closing). */
  close(): void {
    for (const w of [...this.#waiters]) w.done(undefined, failure('kv_cache_full', 'the worker is closing'));
  }

  /** Takes a waiter out of the queue; the next ones may fit now. */
  #leave(w: Waiter): void {
    const i = this.#waiters.indexOf(w);
    if (i < 0) return;
    this.#waiters.splice(i, 1);
    if (i === 0) this.#serve();
  }

  /** Hands free blocks to waiters in order, while the head fits. */
  #serve(): void {
    while (this.#waiters.length > 0 && this.#waiters[0].n <= this.#free.length) {
      const w = this.#waiters.shift()!;
      w.done(this.#free.splice(this.#free.length - w.n, w.n).reverse());
    }
  }
}
