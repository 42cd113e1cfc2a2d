// The workers of one stage (encode, prefill or decode): which one takes the
// next request (round-robin or least-outstanding, healthy ones only), and
// health checks that take a worker out and bring it back.
import { type RoutingOptions, pickByLoad } from '../fleet/routing';

/**
 * How a pool picks a worker ('load': reported load and free blocks, prefix
 * affinity; fleet/routing.ts. 'precise': the prefill holding the longest
 * run of the prompt's blocks by the workers' KV events; kv-index/precise.ts).
 */
export type Policy = 'round-robin' | 'least-outstanding' | 'load' | 'precise';

/** A policy that lives outside the pool (precise): picks among the healthy workers given the request's hint. */
export interface PoolRouter {
  pick(from: readonly WorkerRef[], hint: unknown, turn: number): WorkerRef | undefined;
  /** The worker left the pool: forget what it held. */
  left?(w: WorkerRef): void;
}
export type { Stage, WorkerRef } from './worker-ref';
import type { Stage, WorkerRef } from './worker-ref';

/** The workers of one stage, with the policy that picks among the healthy ones. */
export class WorkerPool {
  readonly workers: WorkerRef[];
  #next = 0;
  /**
   * Picks for the 'precise' policy (set by the proxy); without it, the pool falls back to 'load'.
   * @internal
   */
  router?: PoolRouter;

  constructor(
    readonly stage: Stage,
    addresses: string[],
    readonly policy: Policy = 'round-robin',
    readonly routing: RoutingOptions = {},
  ) {
    this.workers = addresses.map((address) => ({ address, stage, healthy: true, outstanding: 0, failures: 0 }));
  }

  /** Adds a worker (healthy until a check or a request says otherwise). */
  add(address: string): WorkerRef {
    const w: WorkerRef = { address, stage: this.stage, healthy: true, outstanding: 0, failures: 0 };
    this.workers.push(w);
    return w;
  }

  /** Takes a worker out: no new requests; those in flight finish on it. */
  remove(w: WorkerRef): boolean {
    const i = this.workers.indexOf(w);
    if (i >= 0) this.workers.splice(i, 1);
    if (i >= 0) this.router?.left?.(w);
    return i >= 0;
  }

  get size(): number {
    return this.workers.length;
  }

  /**
   * A healthy worker not in `avoid` (falls back to `avoid` ones when nothing
   * else is healthy), among those `accept` takes (all by default); `key`: the
   * request's prefix affinity ('load' policy).
   */
  pick(
    avoid: ReadonlySet<WorkerRef> = new Set(),
    key?: string | object,
    accept?: (w: WorkerRef) => boolean,
  ): WorkerRef | undefined {
    const healthy = this.workers.filter((w) => w.healthy && (!accept || accept(w)));
    const preferred = healthy.filter((w) => !avoid.has(w));
    const from = preferred.length > 0 ? preferred : healthy;
    if (from.length === 0) return undefined;
    if (this.policy === 'precise' && this.router) return this.router.pick(from, key, this.#next++);
    if (this.policy === 'load' || this.policy === 'precise')
      return pickByLoad(from, this.#next++, typeof key === 'string' ? key : undefined, this.routing);
    if (this.policy === 'least-outstanding') {
      // Ties go round-robin, so equal workers share the load.
      const min = Math.min(...from.map((w) => w.outstanding));
      const tied = from.filter((w) => w.outstanding === min);
      return tied[this.#next++ % tied.length];
    }
    return from[this.#next++ % from.length];
  }

  /** Whether any worker is healthy now (pick() without taking a turn). */
  get anyHealthy(): boolean {
    return this.workers.some((w) => w.healthy);
  }

  /** A request to it failed for a reason of its own (connection refused, reset, 5xx): out until a check passes. */
  markFailed(w: WorkerRef): void {
    w.failures++;
    w.healthy = false;
  }

  /** Marks a worker healthy again (a health check or a call succeeded). */
  markOk(w: WorkerRef): void {
    w.failures = 0;
    w.healthy = true;
  }
}
