// The proxy's Prometheus registry: its nixl_node_proxy_* series, and the
// client's view of each answer (TTFT, inter-token latency, end-to-end) per
// route, in vLLM's buckets. These are not named vllm:* so that a dashboard
// summing the workers' vllm:* series does not count each request twice.
// prom-client is optional: without it the proxy runs and /metrics says so.
import type * as http from 'node:http';
import type { Counter, Gauge, Histogram, Registry } from 'prom-client';
import { VLLM_BUCKETS } from '../api/vllm-buckets';

type Prom = typeof import('prom-client');

/** The proxy's own counts (ServingProxy.stats), kept with or without prom-client. */
export interface ProxyStats {
  requests: number;
  completed: number;
  failed: number;
  aborted: number;
  /** Stages run again on another worker. */
  retries: number;
  /** Requests prefilled again because their decode's pull expired, or their decode failed. */
  expiredRetries: number;
  decodeRetries: number;
  /** Prefill (and held-turn) holds freed early (decode failed or client gone), instead of at lease end. */
  holdsReleased: number;
}

export function proxyStats(): ProxyStats {
  return {
    requests: 0,
    completed: 0,
    failed: 0,
    aborted: 0,
    retries: 0,
    expiredRetries: 0,
    decodeRetries: 0,
    holdsReleased: 0,
  };
}

/** The proxy's metrics; create() is undefined without prom-client. */
export class ProxyMetrics {
  readonly registry: Registry;
  readonly requests: Counter<string>;
  readonly stageSeconds: Histogram<string>;
  readonly inflight: Gauge<string>;
  readonly healthy: Gauge<string>;
  readonly #ttft: Histogram<string>;
  readonly #itl: Histogram<string>;
  readonly #e2e: Histogram<string>;

  static create(): ProxyMetrics | undefined {
    try {
      return new ProxyMetrics(require('prom-client') as Prom);
    } catch {
      return undefined;
    }
  }

  private constructor(prom: Prom) {
    const registry = new prom.Registry();
    const registers = [registry];
    this.registry = registry;
    this.requests = new prom.Counter({
      name: 'nixl_node_proxy_requests_total',
      help: 'Requests by route and status',
      labelNames: ['route', 'status'],
      registers,
    });
    this.stageSeconds = new prom.Histogram({
      name: 'nixl_node_proxy_stage_seconds',
      help: 'Time of each stage, to the answer (decode: to the first byte)',
      labelNames: ['stage', 'outcome'],
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers,
    });
    this.inflight = new prom.Gauge({
      name: 'nixl_node_proxy_inflight_requests',
      help: 'Requests in flight',
      registers,
    });
    this.healthy = new prom.Gauge({
      name: 'nixl_node_proxy_worker_healthy',
      help: '1 when a worker passes its health check',
      labelNames: ['stage', 'worker'],
      registers,
    });
    const histogram = (name: string, help: string, buckets: readonly number[]) =>
      new prom.Histogram({ name, help, labelNames: ['route'], buckets: [...buckets], registers });
    this.#ttft = histogram(
      'nixl_node_proxy_time_to_first_token_seconds',
      'Time from the request to the first token the client got (a whole answer: to the answer), seconds',
      VLLM_BUCKETS.ttft,
    );
    this.#itl = histogram(
      'nixl_node_proxy_inter_token_latency_seconds',
      'Time between two streamed chunks the client got, seconds',
      VLLM_BUCKETS.itl,
    );
    this.#e2e = histogram(
      'nixl_node_proxy_e2e_request_latency_seconds',
      'Time from the request to the end of its answer, answered requests only, seconds',
      VLLM_BUCKETS.e2e,
    );
  }

  /**
   * Times the answer `res` gives to one request on `route`: each SSE event
   * written is a token (the first one TTFT); a whole answer's TTFT is its
   * end. Only answers that end with status 200 count.
   */
  timeAnswer(route: string, res: http.ServerResponse): void {
    const t0 = performance.now();
    const labels = { route };
    let last: number | undefined;
    const write = res.write.bind(res) as (...a: unknown[]) => boolean;
    res.write = ((...a: unknown[]) => {
      const chunk = a[0];
      const s = typeof chunk === 'string' ? chunk : Buffer.isBuffer(chunk) ? chunk.toString('latin1', 0, 12) : '';
      if (s.startsWith('data: ') && !s.startsWith('data: [DONE]')) {
        const now = performance.now();
        if (last === undefined) this.#ttft.observe(labels, (now - t0) / 1000);
        else this.#itl.observe(labels, (now - last) / 1000);
        last = now;
      }
      return write(...a);
    }) as typeof res.write;
    res.once('finish', () => {
      if (res.statusCode !== 200) return;
      const s = (performance.now() - t0) / 1000;
      if (last === undefined) this.#ttft.observe(labels, s);
      this.#e2e.observe(labels, s);
    });
  }
}
