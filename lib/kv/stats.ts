// Transfer statistics like vLLM's NixlKVConnectorStats, as an object and as
// Prometheus text.
/** Histogram buckets of transfer times, ms. */
export const BUCKETS_MS = [0.1, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 5000];

class Histogram {
  readonly counts = new Array<number>(BUCKETS_MS.length + 1).fill(0);
  sum = 0;
  n = 0;

  observe(ms: number): void {
    this.sum += ms;
    this.n++;
    let i = BUCKETS_MS.findIndex((b) => ms <= b);
    if (i < 0) i = BUCKETS_MS.length;
    this.counts[i]++;
  }

  lines(name: string, help: string, labels: string): string[] {
    const out = [`# HELP ${name} ${help}`, `# TYPE ${name} histogram`];
    let acc = 0;
    BUCKETS_MS.forEach((b, i) => {
      acc += this.counts[i];
      out.push(`${name}_bucket{${labels}${labels ? ',' : ''}le="${b / 1000}"} ${acc}`);
    });
    out.push(`${name}_bucket{${labels}${labels ? ',' : ''}le="+Inf"} ${this.n}`);
    out.push(`${name}_sum{${labels}} ${this.sum / 1000}`, `${name}_count{${labels}} ${this.n}`);
    return out;
  }
}

/** A puller's counters at one moment. */
export interface KvStatsSnapshot {
  transfers: number;
  failedTransfers: number;
  failedNotifications: number;
  bytesTransferred: number;
  descriptors: number;
  transferTimeMs: { sum: number; count: number; avg: number };
  postTimeMs: { sum: number; count: number; avg: number };
  /** Pulls refused or failed because the prefill's lease ran out (or would have) before the read ended. */
  pullsExpired: number;
  /** Pulls checked against a lease, and the last check's figures (ms). */
  leaseChecks: number;
  lastLeaseLeftMs: number | null;
  lastLeaseMarginMs: number | null;
}

/** Told of every record as it happens (registerKvMetrics feeds prom-client from it). */
export interface KvStatsSink {
  /** A transfer finished. */
  transfer(bytes: number, descriptors: number, postMs: number, transferMs: number): void;
  /** A transfer failed. */
  failedTransfer(): void;
  /** A completion notification could not be sent. */
  failedNotification(): void;
  /** A pull expired (its lease ran out). */
  expired?(): void;
}

/** A puller's counters, with sinks (metrics) told of each event. */
export class KvStats {
  readonly sinks = new Set<KvStatsSink>();
  transfers = 0;
  failedTransfers = 0;
  failedNotifications = 0;
  bytesTransferred = 0;
  descriptors = 0;
  pullsExpired = 0;
  leaseChecks = 0;
  lastLeaseLeftMs: number | null = null;
  lastLeaseMarginMs: number | null = null;
  readonly #xfer = new Histogram();
  readonly #post = new Histogram();

  /** Counts a finished transfer. */
  recordTransfer(bytes: number, descriptors: number, postMs: number, transferMs: number): void {
    this.transfers++;
    this.bytesTransferred += bytes;
    this.descriptors += descriptors;
    this.#post.observe(postMs);
    this.#xfer.observe(transferMs);
    for (const s of this.sinks) s.transfer(bytes, descriptors, postMs, transferMs);
  }

  /** Counts a failed transfer. */
  recordFailedTransfer(): void {
    this.failedTransfers++;
    for (const s of this.sinks) s.failedTransfer();
  }

  /** Counts a notification that could not be sent. */
  recordFailedNotification(): void {
    this.failedNotifications++;
    for (const s of this.sinks) s.failedNotification();
  }

  /** A pull about to start: how long its lease has left and the margin it must keep. */
  recordLeaseCheck(leftMs: number, marginMs: number): void {
    this.leaseChecks++;
    this.lastLeaseLeftMs = leftMs;
    this.lastLeaseMarginMs = marginMs;
  }

  /** Counts a pull that expired. */
  recordExpired(): void {
    this.pullsExpired++;
    for (const s of this.sinks) s.expired?.();
  }

  /** The counters now. */
  snapshot(): KvStatsSnapshot {
    const h = (x: Histogram) => ({ sum: x.sum, count: x.n, avg: x.n ? x.sum / x.n : 0 });
    return {
      transfers: this.transfers,
      failedTransfers: this.failedTransfers,
      failedNotifications: this.failedNotifications,
      bytesTransferred: this.bytesTransferred,
      descriptors: this.descriptors,
      transferTimeMs: h(this.#xfer),
      postTimeMs: h(this.#post),
      pullsExpired: this.pullsExpired,
      leaseChecks: this.leaseChecks,
      lastLeaseLeftMs: this.lastLeaseLeftMs,
      lastLeaseMarginMs: this.lastLeaseMarginMs,
    };
  }

  /** Prometheus text exposition; labels like { engine_id: 'decode-0' }. */
  prometheus(labels: Record<string, string> = {}): string {
    const l = Object.entries(labels)
      .map(([k, v]) => `${k}="${v.replace(/["\\\n]/g, '_')}"`)
      .join(',');
    const counter = (name: string, help: string, v: number) => [
      `# HELP ${name} ${help}`,
      `# TYPE ${name} counter`,
      `${name}{${l}} ${v}`,
    ];
    return `${[
      ...counter('nixl_node_transfers_total', 'KV block pulls completed', this.transfers),
      ...counter('nixl_node_failed_transfers_total', 'KV block pulls that failed', this.failedTransfers),
      ...counter(
        'nixl_node_failed_notifications_total',
        'notifications that could not be sent',
        this.failedNotifications,
      ),
      ...counter('nixl_node_bytes_transferred_total', 'bytes pulled', this.bytesTransferred),
      ...counter('nixl_node_descriptors_total', 'descriptors posted', this.descriptors),
      ...counter(
        'nixl_node_pulls_expired_total',
        "pulls refused or failed because the prefill's lease ran out before the read ended",
        this.pullsExpired,
      ),
      ...this.#xfer.lines('nixl_node_transfer_seconds', 'time from post to completion', l),
      ...this.#post.lines('nixl_node_post_seconds', 'time to build and post the transfer', l),
    ].join('\n')}\n`;
  }
}
