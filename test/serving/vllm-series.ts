// vLLM's Prometheus series as vLLM exports them (read from its source:
// vllm/v1/metrics/loggers.py PrometheusStatLogger and the NIXL connector's
// NixlPromMetrics), and a reader of exposition text, for the tests that
// scrape a worker's /metrics.
import { expect } from 'vitest';

/** Each metric family of a Prometheus text: its type, bucket bounds, label names and samples. */
export function families(text: string) {
  const out = new Map<string, { type: string; le: number[]; labels: Set<string>; samples: Map<string, number> }>();
  for (const line of text.split('\n')) {
    const t = /^# TYPE (\S+) (\S+)$/.exec(line);
    if (t) out.set(t[1], { type: t[2], le: [], labels: new Set(), samples: new Map() });
    const s = /^([^\s{]+)(?:\{([^}]*)\})? (\S+)$/.exec(line);
    if (!s) continue;
    const fam = [...out.keys()].reverse().find((n) => s[1] === n || s[1].startsWith(`${n}_`));
    if (!fam) continue;
    const f = out.get(fam)!;
    const labels = Object.fromEntries([...(s[2] ?? '').matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
    for (const k of Object.keys(labels)) if (k !== 'le') f.labels.add(k);
    if (s[1] === `${fam}_bucket` && labels.le !== '+Inf') f.le.push(Number(labels.le));
    f.samples.set(s[1], (f.samples.get(s[1]) ?? 0) + Number(s[3]));
  }
  return out;
}

// vLLM's: name -> [type, buckets]. Counters as its Python client writes them (with _total).
export const TTFT = [
  0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
  640.0, 2560.0,
];
export const ITL = [
  0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
export const E2E = [
  0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
  7680.0,
];
const NIXL_TIME = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];
export const VLLM: Record<string, [string, number[]]> = {
  'vllm:nixl_xfer_time_seconds': ['histogram', NIXL_TIME.slice(1)],
  'vllm:nixl_post_time_seconds': ['histogram', NIXL_TIME],
  'vllm:nixl_bytes_transferred': ['histogram', [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23].map((i) => 2 ** (10 + i))],
  'vllm:nixl_num_descriptors': [
    'histogram',
    [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
  ],
  'vllm:nixl_num_failed_transfers_total': ['counter', []],
  'vllm:nixl_num_failed_notifications_total': ['counter', []],
  'vllm:nixl_num_kv_expired_reqs_total': ['counter', []],
  'vllm:time_to_first_token_seconds': ['histogram', TTFT],
  'vllm:inter_token_latency_seconds': ['histogram', ITL],
  'vllm:e2e_request_latency_seconds': ['histogram', E2E],
  'vllm:num_requests_running': ['gauge', []],
  'vllm:num_requests_waiting': ['gauge', []],
  'vllm:kv_cache_usage_perc': ['gauge', []],
  'vllm:prefix_cache_queries_total': ['counter', []],
  'vllm:prefix_cache_hits_total': ['counter', []],
};

/** Checks that a scrape has each of vLLM's series with its type, buckets and labels; returns its families. */
export function expectVllmSeries(text: string): ReturnType<typeof families> {
  const f = families(text);
  for (const [name, [type, le]] of Object.entries(VLLM)) {
    const got = f.get(name);
    expect(got, name).toBeDefined();
    expect({ name, type: got!.type, le: got!.le }).toEqual({ name, type, le });
    expect([...got!.labels].sort(), name).toEqual(['engine', 'model_name']);
    expect(got!.samples.size, `${name} has a sample`).toBeGreaterThan(0);
  }
  return f;
}

/** A family's sample (0 when absent). */
export function sample(f: ReturnType<typeof families>, family: string, name = family): number {
  return f.get(family)?.samples.get(name) ?? 0;
}
