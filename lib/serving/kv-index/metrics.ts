// The KV-event index's Prometheus series on the proxy's registry (prom-client
// is optional: without it the counts stay in PreciseRouting.stats only).
import type { Counter, Registry } from 'prom-client';

export interface KvIndexMetrics {
  count(what: string, n: number, label?: string): void;
}

const COUNTERS: Record<string, [string, string, string?]> = {
  applied: ['nixl_node_proxy_kv_events_applied_total', 'KV events applied to the index'],
  gaps: ['nixl_node_proxy_kv_event_gaps_total', 'Sequence gaps seen in a publisher stream'],
  replays: ['nixl_node_proxy_kv_event_replays_total', 'Replays asked of a publisher (on connect and on a gap)'],
  restarts: ['nixl_node_proxy_kv_event_restarts_total', 'Publishers whose sequence went backwards (index cleared)'],
  replay_lost: [
    'nixl_node_proxy_kv_event_replay_lost_total',
    'Gaps no replay could cover: the worker index was cleared and rebuilt from the next batch',
  ],
  duplicates: ['nixl_node_proxy_kv_event_duplicates_total', 'Batches already applied, skipped'],
  held_overflow: ['nixl_node_proxy_kv_event_held_overflow_total', 'Live batches not held during a replay (limit)'],
  dropped: ['nixl_node_proxy_kv_events_dropped_total', 'Events or messages dropped, by reason', 'reason'],
  refused: [
    'nixl_node_proxy_kv_events_refused_total',
    'Advertised KV-event publishers not followed (block size not a multiple of the proxy one), by reason',
    'reason',
  ],
  decisions: ['nixl_node_proxy_kv_routing_decisions_total', 'Precise routing decisions, by reason', 'reason'],
};

export function kvIndexMetrics(registry: Registry, size: () => number): KvIndexMetrics | undefined {
  let prom: typeof import('prom-client');
  try {
    prom = require('prom-client');
  } catch {
    return undefined;
  }
  const counters = new Map<string, Counter<string>>();
  for (const [k, [name, help, label]] of Object.entries(COUNTERS)) {
    counters.set(k, new prom.Counter({ name, help, labelNames: label ? [label] : [], registers: [registry] }));
  }
  new prom.Gauge({
    name: 'nixl_node_proxy_kv_index_blocks',
    help: 'Blocks in the proxy KV index, all workers together',
    registers: [registry],
    collect() {
      this.set(size());
    },
  });
  return {
    count(what, n, label) {
      const c = counters.get(what);
      if (!c) return;
      if (label) c.inc({ [COUNTERS[what][2] ?? 'reason']: label }, n);
      else c.inc(n);
    },
  };
}
