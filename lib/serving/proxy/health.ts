// The proxy's view of its workers' health: rounds of health checks that take
// a worker out and bring it back (and learn what it serves), the ejection of
// a worker a request found dead, and the log line when the prefill and
// decode pools stop serving one model.
import type { Logger } from '../log';
import type { ProxyMetrics } from './metrics';
import { modelMismatch } from './pairing';
import type { Stage, WorkerPool, WorkerRef } from './pool';
import type { WorkerTransport } from './transports/types';

export class HealthRounds {
  readonly #pools: Readonly<Record<Stage, WorkerPool>>;
  readonly #transport: WorkerTransport;
  readonly #log: Logger;
  readonly #prom?: ProxyMetrics;
  /** The last model mismatch logged (logged again only when it changes). */
  #mismatch?: string;
  #timer?: NodeJS.Timeout;

  constructor(
    pools: Readonly<Record<Stage, WorkerPool>>,
    transport: WorkerTransport,
    log: Logger,
    prom?: ProxyMetrics,
  ) {
    this.#pools = pools;
    this.#transport = transport;
    this.#log = log;
    this.#prom = prom;
  }

  /**
   * One round of health checks over every worker. `learnOnly`: only learn
   * what the workers serve; one slow to answer its first check (a process
   * just started, a ZeroMQ peer still connecting) is not taken out for it.
   */
  async check(o: { learnOnly?: boolean } = {}): Promise<void> {
    const all = Object.values(this.#pools).flatMap((p) => p.workers.map((w) => ({ p, w })));
    await Promise.all(
      all.map(async ({ p, w }) => {
        const { ok, cause } = await this.#transport.healthCheck(w, 1000);
        if (o.learnOnly && !ok) return;
        // Read after the check: rounds may overlap, and only the one that changes the state logs it.
        const was = w.healthy;
        const fields = { stage: w.stage, worker: w.address, model: w.model };
        if (ok) {
          p.markOk(w);
          if (!was) this.#log.info(fields, 'worker healthy again');
        } else {
          p.markFailed(w);
          if (was) this.#log.warn({ ...fields, cause }, 'worker unhealthy: its health check failed');
        }
        this.#prom?.healthy.set({ stage: w.stage, worker: w.address }, ok ? 1 : 0);
      }),
    );
    const mismatch = modelMismatch(this.#pools.prefill, this.#pools.decode);
    if (mismatch && mismatch !== this.#mismatch) this.#log.error({ reason: 'model_mismatch' }, mismatch);
    else if (!mismatch && this.#mismatch) this.#log.info({}, 'prefill and decode workers serve one model again');
    this.#mismatch = mismatch;
  }

  /** A round every `everyMs` from now on, until stop(). */
  every(everyMs: number): void {
    this.#timer = setInterval(() => void this.check(), everyMs);
    this.#timer.unref();
  }

  stop(): void {
    clearInterval(this.#timer);
  }

  /** Takes a worker out after a failed request, until a health check passes. */
  eject(w: WorkerRef, why: string): void {
    if (w.healthy) this.#log.warn({ stage: w.stage, worker: w.address, reason: why }, 'worker ejected');
    this.#pools[w.stage].markFailed(w);
  }
}
