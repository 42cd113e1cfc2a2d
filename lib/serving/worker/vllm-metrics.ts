// A worker's /metrics under vLLM's names, types, buckets and labels
// (model_name, engine), so that the dashboards and alerts written for vLLM,
// llm-d and Dynamo read nixl-node workers unchanged; nixl-node's own
// nixl_node_* series (registerKvMetrics) go in the same registry. The names
// and buckets are vLLM's: vllm/v1/metrics/loggers.py (PrometheusStatLogger)
// and the NIXL connector's NixlPromMetrics. prom-client is an optional
// dependency, loaded only here.
import type { Counter, Histogram, Registry } from 'prom-client';
import { NixlError } from '../../errors';
import { registerKvMetrics } from '../../kv/metrics';
import type { PrefillTracker } from '../../kv/prefill';
import type { KvPuller } from '../../kv/pull/puller';
import type { BlockPool } from './blocks';
import type { Sink } from './fronts/front';
import { VLLM_BUCKETS } from '../api/vllm-buckets';

type Prom = typeof import('prom-client');

/** prom-client, or an error with a code naming the package to install. */
export function loadPromClient(): Prom {
  try {
    return require('prom-client') as Prom;
  } catch (e) {
    throw new NixlError('/metrics needs prom-client: npm install prom-client@15', 'NIXL_ERR_NOT_FOUND', undefined, {
      cause: e,
    });
  }
}

/** What the request gauges and prefix-cache counters read at each scrape. */
export interface WorkerMetricsView {
  /** Requests in progress (waiting for blocks included). */
  active(): number;
  /** Requests waiting for KV blocks. */
  waiting(): number;
  /** Share of the KV cache in use, 0 to 1 (vLLM: "1 means 100 percent usage"). */
  kvUsage(): number;
  /** Prompt tokens looked up in the prefix cache, and tokens found there. */
  prefixQueries(): number;
  prefixHits(): number;
}

/** A worker's prefix-cache counts (WorkerStats). */
type PrefixCounts = { prefixReusedTokens: number; prefillEvaluatedTokens: number };

/** The worker's parts the view reads. */
function workerView(
  blocks: Pick<BlockPool, 'waiting' | 'available' | 'size'>,
  stats: PrefixCounts,
  active: () => number,
): WorkerMetricsView {
  return {
    active,
    waiting: () => blocks.waiting,
    kvUsage: () => 1 - blocks.available / blocks.size,
    prefixQueries: () => stats.prefixReusedTokens + stats.prefillEvaluatedTokens,
    prefixHits: () => stats.prefixReusedTokens,
  };
}

/** The times of one request, for TTFT, ITL and end-to-end latency. */
export class RequestTimer {
  readonly #t0 = performance.now();
  #last?: number;

  constructor(
    readonly ttft: Histogram<string>,
    readonly itl: Histogram<string>,
    readonly e2e: Histogram<string>,
    readonly labels: Record<string, string>,
  ) {}

  /** A piece of the answer was made (the first is the first token). */
  token(): void {
    const now = performance.now();
    if (this.#last === undefined) this.ttft.observe(this.labels, (now - this.#t0) / 1000);
    else this.itl.observe(this.labels, (now - this.#last) / 1000);
    this.#last = now;
  }

  /** The answer ended; only answered requests count (vLLM records finished requests). */
  end(ok: boolean): void {
    if (ok) this.e2e.observe(this.labels, (performance.now() - this.#t0) / 1000);
  }
}

/** A worker's registry: vLLM's series plus nixl-node's. */
export class WorkerMetrics {
  readonly registry: Registry;
  readonly #labels: Record<string, string>;
  readonly #ttft: Histogram<string>;
  readonly #itl: Histogram<string>;
  readonly #e2e: Histogram<string>;
  readonly #stops: Array<() => void> = [];

  /** Undefined when prom-client is not installed (then /metrics answers 501 and says so). */
  static create(
    modelName: string,
    puller: KvPuller,
    tracker: PrefillTracker,
    blocks: Pick<BlockPool, 'waiting' | 'available' | 'size'>,
    stats: PrefixCounts,
    active: () => number,
  ): WorkerMetrics | undefined {
    let prom: Prom;
    try {
      prom = loadPromClient();
    } catch {
      return undefined;
    }
    return new WorkerMetrics(prom, { modelName, puller, tracker, view: workerView(blocks, stats, active) });
  }

  private constructor(
    prom: Prom,
    o: { modelName: string; engine?: string; puller: KvPuller; tracker: PrefillTracker; view: WorkerMetricsView },
  ) {
    const registry = new prom.Registry();
    this.registry = registry;
    const labels = { model_name: o.modelName, engine: o.engine ?? '0' };
    this.#labels = labels;
    const labelNames = Object.keys(labels);
    // Each series starts at 0 under its labels, as vLLM's per-engine ones do, so a scrape lists every name.
    const histogram = (name: string, help: string, buckets: readonly number[]) => {
      const h = new prom.Histogram({ name, help, labelNames, buckets: [...buckets], registers: [registry] });
      h.zero(labels);
      return h;
    };
    // prom-client writes counters under the name given; vLLM's Python client adds _total.
    const counter = (name: string, help: string) => {
      const c = new prom.Counter({ name: `${name}_total`, help, labelNames, registers: [registry] });
      c.inc(labels, 0);
      return c;
    };
    const gauge = (name: string, help: string, read: () => number) =>
      new prom.Gauge({
        name,
        help,
        labelNames,
        registers: [registry],
        collect() {
          this.set(labels, read());
        },
      });
    const v = o.view;
    gauge('vllm:num_requests_running', 'Number of requests in model execution batches.', () =>
      Math.max(0, v.active() - v.waiting()),
    );
    gauge('vllm:num_requests_waiting', 'Number of requests waiting to be processed.', v.waiting);
    gauge('vllm:kv_cache_usage_perc', 'KV-cache usage. 1 means 100 percent usage.', v.kvUsage);
    const total = (c: Counter<string>, read: () => number) => {
      // Read at scrape time from the worker's own counts, which only grow.
      (c as unknown as { collect: () => void }).collect = () => {
        c.reset();
        c.inc(labels, read());
      };
    };
    total(
      counter('vllm:prefix_cache_queries', 'Prefix cache queries, in terms of number of queried tokens.'),
      v.prefixQueries,
    );
    total(counter('vllm:prefix_cache_hits', 'Prefix cache hits, in terms of number of cached tokens.'), v.prefixHits);
    this.#ttft = histogram(
      'vllm:time_to_first_token_seconds',
      'Histogram of time to first token in seconds.',
      VLLM_BUCKETS.ttft,
    );
    this.#itl = histogram(
      'vllm:inter_token_latency_seconds',
      'Histogram of inter-token latency in seconds.',
      VLLM_BUCKETS.itl,
    );
    this.#e2e = histogram(
      'vllm:e2e_request_latency_seconds',
      'Histogram of e2e request latency in seconds.',
      VLLM_BUCKETS.e2e,
    );
    this.#nixl(o.puller, o.tracker, histogram, counter);
    // nixl-node's own series (what registerKvMetrics exports), beside vLLM's.
    this.#stops.push(
      registerKvMetrics(registry as never, {
        puller: o.puller,
        tracker: o.tracker,
        labels: { engine_id: o.engine ?? '0' },
      }),
    );
  }

  /** NixlPromMetrics: a decode's pulls, and a prefill's requests whose KV expired unread. */
  #nixl(
    puller: KvPuller,
    tracker: PrefillTracker,
    histogram: (name: string, help: string, buckets: readonly number[]) => Histogram<string>,
    counter: (name: string, help: string) => Counter<string>,
  ): void {
    const l = this.#labels;
    const xfer = histogram(
      'vllm:nixl_xfer_time_seconds',
      'Histogram of transfer duration for NIXL KV Cache transfers.',
      VLLM_BUCKETS.nixlTime.slice(1),
    );
    const post = histogram(
      'vllm:nixl_post_time_seconds',
      'Histogram of transfer post time for NIXL KV Cache transfers.',
      VLLM_BUCKETS.nixlTime,
    );
    const bytes = histogram(
      'vllm:nixl_bytes_transferred',
      'Histogram of bytes transferred per NIXL KV Cache transfers.',
      VLLM_BUCKETS.nixlBytes,
    );
    const descs = histogram(
      'vllm:nixl_num_descriptors',
      'Histogram of number of descriptors per NIXL KV Cache transfers.',
      VLLM_BUCKETS.nixlDescriptors,
    );
    const failed = counter('vllm:nixl_num_failed_transfers', 'Number of failed NIXL KV Cache transfers.');
    const failedNotifs = counter('vllm:nixl_num_failed_notifications', 'Number of failed NIXL KV Cache notifications.');
    const expired = counter(
      'vllm:nixl_num_kv_expired_reqs',
      'Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.',
    );
    const pulls = {
      transfer(b: number, d: number, postMs: number, transferMs: number) {
        xfer.observe(l, transferMs / 1000);
        post.observe(l, postMs / 1000);
        bytes.observe(l, b);
        descs.observe(l, d);
      },
      failedTransfer: () => failed.inc(l),
      failedNotification: () => failedNotifs.inc(l),
    };
    puller.stats.sinks.add(pulls);
    const holds = {
      released: (r: { reason: string }) => {
        if (r.reason === 'expired') expired.inc(l);
      },
      unrecognized() {},
      lateRead() {},
    };
    tracker.sinks.add(holds);
    this.#stops.push(() => puller.stats.sinks.delete(pulls));
    this.#stops.push(() => tracker.sinks.delete(holds));
  }

  /** Times one request: the sink it answers into, wrapped (pieces of text are told by token()). */
  track(sink: Sink): Sink {
    const t = new RequestTimer(this.#ttft, this.#itl, this.#e2e, this.#labels);
    return {
      ...sink,
      chunk: (c) => sink.chunk(c),
      token: () => t.token(),
      end: (status, body) => {
        t.end(status === 200);
        sink.end(status, body);
      },
    };
  }

  /** The exposition text and its content type. */
  async scrape(): Promise<{ contentType: string; text: string }> {
    return { contentType: this.registry.contentType, text: await this.registry.metrics() };
  }

  /** Stops following the puller and the tracker. */
  close(): void {
    for (const s of this.#stops.splice(0)) s();
  }
}
