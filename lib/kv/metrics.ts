// The puller's and the tracker's metrics in prom-client, the library Node
// services already expose: registered in the Registry the caller passes.
// prom-client is an optional peer dependency, loaded only here; without it,
// KvStats.prometheus() still gives the text format.
import type { Registry } from 'prom-client';
import { NixlError } from '../errors';
import type { KvPuller } from './pull/puller';
import type { PrefillTracker } from './prefill';
import { BUCKETS_MS } from './stats';

/**
 * A prom-client Registry, typed structurally so that this package's types
 * compile for users who do not install prom-client.
 */
export interface PromRegistry {
  /** Registers a metric. */
  registerMetric(metric: never): void;
}

/** What registerKvMetrics exports: a puller's stats, a prefill tracker's, or both. */
export interface KvMetricsOptions {
  puller?: KvPuller;
  tracker?: PrefillTracker;
  /** Constant labels on every metric, e.g. { engine_id: 'decode-0', rank: '0' }. */
  labels?: Record<string, string>;
  /** Metric name prefix. Default 'nixl_node_'. */
  prefix?: string;
}

type PromClient = typeof import('prom-client');

function promClient(): PromClient {
  try {
    return require('prom-client') as PromClient;
  } catch (e) {
    throw new NixlError(
      'registerKvMetrics needs prom-client: npm install prom-client',
      'NIXL_ERR_NOT_FOUND',
      undefined,
      {
        cause: e,
      },
    );
  }
}

/**
 * Registers counters and histograms of a KvPuller and/or a PrefillTracker in
 * `registry`; they follow every transfer from now on (counters start at what
 * the puller counted so far). Returns a function that stops the updates.
 */
export function registerKvMetrics(promRegistry: PromRegistry, o: KvMetricsOptions): () => void {
  const prom = promClient();
  const registry = promRegistry as unknown as Registry;
  const p = o.prefix ?? 'nixl_node_';
  const labels = o.labels ?? {};
  const labelNames = Object.keys(labels);
  const buckets = BUCKETS_MS.map((ms) => ms / 1000);
  const m: Makers = {
    prom,
    registry,
    prefix: p,
    labels,
    labelNames,
    counter: (name, help, extra = []) =>
      new prom.Counter({ name: p + name, help, labelNames: [...labelNames, ...extra], registers: [registry] }),
    histogram: (name, help) => new prom.Histogram({ name: p + name, help, labelNames, buckets, registers: [registry] }),
  };
  const stops: Array<() => void> = [];
  if (o.puller) stops.push(pullerMetrics(m, o.puller));
  if (o.tracker) stops.push(trackerMetrics(m, o.tracker));
  return () => {
    for (const s of stops) s();
  };
}

/** What the metrics of one registration are made with. */
interface Makers {
  prom: typeof import('prom-client');
  registry: Registry;
  prefix: string;
  labels: Record<string, string>;
  labelNames: string[];
  counter(name: string, help: string, extra?: string[]): import('prom-client').Counter<string>;
  histogram(name: string, help: string): import('prom-client').Histogram<string>;
}

/** A puller's counters (from what it counted so far) and histograms; returns what stops them. */
function pullerMetrics(m: Makers, puller: NonNullable<KvMetricsOptions['puller']>): () => void {
  const { counter, histogram, labels } = m;
  const stats = puller.stats;
  const transfers = counter('transfers_total', 'KV block pulls completed');
  const failed = counter('failed_transfers_total', 'KV block pulls that failed');
  const failedNotifs = counter('failed_notifications_total', 'notifications that could not be sent');
  const bytes = counter('bytes_transferred_total', 'bytes pulled');
  const descs = counter('descriptors_total', 'descriptors posted');
  const expired = counter(
    'pulls_expired_total',
    "pulls refused or failed because the prefill's lease ran out before the read ended",
  );
  const xfer = histogram('transfer_seconds', 'time from post to completion of a pull');
  const post = histogram('post_seconds', 'time to build and post the transfers of a pull');
  transfers.inc(labels, stats.transfers);
  failed.inc(labels, stats.failedTransfers);
  failedNotifs.inc(labels, stats.failedNotifications);
  bytes.inc(labels, stats.bytesTransferred);
  descs.inc(labels, stats.descriptors);
  expired.inc(labels, stats.pullsExpired);
  const sink = {
    transfer(b: number, d: number, postMs: number, transferMs: number) {
      transfers.inc(labels);
      bytes.inc(labels, b);
      descs.inc(labels, d);
      post.observe(labels, postMs / 1000);
      xfer.observe(labels, transferMs / 1000);
    },
    failedTransfer: () => failed.inc(labels),
    failedNotification: () => failedNotifs.inc(labels),
    expired: () => expired.inc(labels),
  };
  stats.sinks.add(sink);
  return () => stats.sinks.delete(sink);
}

/** A tracker's counters, hold histogram and pending gauge; returns what stops them. */
function trackerMetrics(m: Makers, tracker: NonNullable<KvMetricsOptions['tracker']>): () => void {
  const { counter, histogram, labels } = m;
  const released = counter('prefill_released_total', 'requests whose prefill blocks were freed, by reason', ['reason']);
  const unrecognized = counter(
    'prefill_unrecognized_notifications_total',
    'notifications for requests not tracked (yet)',
  );
  const held = histogram('prefill_hold_seconds', 'time a request held its prefill blocks');
  const late = counter(
    'prefill_late_reads_total',
    'reads reported after the request lease ran out (its blocks may have been reused)',
  );
  late.inc(labels, tracker.lateReads);
  new m.prom.Gauge({
    name: `${m.prefix}prefill_pending_requests`,
    help: 'requests whose blocks wait for decode reads',
    labelNames: m.labelNames,
    registers: [m.registry],
    collect() {
      this.set(labels, tracker.pending);
    },
  });
  const sink = {
    released(r: { reason: string }, heldMs: number) {
      released.inc({ ...labels, reason: r.reason });
      held.observe(labels, heldMs / 1000);
    },
    unrecognized: () => unrecognized.inc(labels),
    lateRead: () => late.inc(labels),
  };
  tracker.sinks.add(sink);
  return () => tracker.sinks.delete(sink);
}
