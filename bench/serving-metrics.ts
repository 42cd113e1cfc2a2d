// The figures vLLM's serving benchmark (`vllm bench serve`) reports, with its
// names and definitions, so that a vLLM user reads ours the same way:
// - TTFT: send to the first streamed text.
// - TPOT (time per output token, excluding the first): (E2EL - TTFT) / (output tokens - 1),
//   one value per request; requests with one output token have none.
// - ITL (inter-token latency): every gap between two streamed text chunks, all requests' gaps pooled.
// - E2EL: send to the last streamed text.
// - mean, median, std (population) and pN of each, in ms; an empty list gives 0, as numpy's `np.mean(xs or 0)`.
// - request_throughput = completed / duration; output_throughput = output tokens / duration (duration in s).
// Percentiles interpolate linearly between closest ranks: numpy's default, which vLLM uses.

/** One streamed request as the client saw it (ms from sending it). */
export interface RequestTiming {
  ttftMs: number;
  /** Send to the last streamed text. */
  e2elMs: number;
  /** completion_tokens of the stream's usage. */
  outputTokens: number;
  /** Gaps between consecutive text chunks (one fewer than the chunks). */
  itlMs: number[];
  promptTokens?: number;
}

/** The percentiles vLLM prints by default for --percentile-metrics ttft,tpot,itl,e2el... and the p90 between. */
export const PERCENTILES = [50, 90, 99] as const;

type Stat = 'mean' | 'median' | 'std' | 'p50' | 'p90' | 'p99';
type Metric = 'ttft' | 'tpot' | 'itl' | 'e2el';

/** vLLM's JSON keys: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ... */
export type ServingMetrics = {
  completed: number;
  total_input_tokens: number;
  total_output_tokens: number;
  /** Seconds. */
  duration: number;
  request_throughput: number;
  output_throughput: number;
  total_token_throughput: number;
} & { [K in `${Stat}_${Metric}_ms`]: number };

/** numpy.percentile(xs, p) with its default linear interpolation; 0 for no values. */
export function percentile(xs: readonly number[], p: number): number {
  if (!(p >= 0 && p <= 100)) throw new RangeError(`percentile: p must be in [0, 100], got ${p}`);
  if (xs.length === 0) return 0;
  const s = [...xs].sort((a, b) => a - b);
  const rank = (p / 100) * (s.length - 1);
  const lo = Math.floor(rank);
  const hi = Math.min(lo + 1, s.length - 1);
  return s[lo] + (s[hi] - s[lo]) * (rank - lo);
}

function mean(xs: readonly number[]): number {
  return xs.length ? xs.reduce((a, x) => a + x, 0) / xs.length : 0;
}

/** Population standard deviation (numpy's default ddof=0). */
function std(xs: readonly number[]): number {
  if (!xs.length) return 0;
  const m = mean(xs);
  return Math.sqrt(xs.reduce((a, x) => a + (x - m) ** 2, 0) / xs.length);
}

/** TPOT of one request; undefined with fewer than two output tokens (vLLM leaves such requests out). */
export function tpotMs(r: RequestTiming): number | undefined {
  return r.outputTokens > 1 ? (r.e2elMs - r.ttftMs) / (r.outputTokens - 1) : undefined;
}

/** The figures over completed requests; durationS: the wall time they took, seconds. */
export function servingMetrics(reqs: readonly RequestTiming[], durationS: number): ServingMetrics {
  const lists: Record<Metric, number[]> = {
    ttft: reqs.map((r) => r.ttftMs),
    tpot: reqs.map(tpotMs).filter((x): x is number => x !== undefined),
    itl: reqs.flatMap((r) => r.itlMs),
    e2el: reqs.map((r) => r.e2elMs),
  };
  const input = reqs.reduce((a, r) => a + (r.promptTokens ?? 0), 0);
  const output = reqs.reduce((a, r) => a + r.outputTokens, 0);
  const per = (n: number) => (durationS > 0 ? n / durationS : 0);
  const out: Record<string, number> = {
    completed: reqs.length,
    total_input_tokens: input,
    total_output_tokens: output,
    duration: durationS,
    request_throughput: per(reqs.length),
    output_throughput: per(output),
    total_token_throughput: per(input + output),
  };
  for (const m of Object.keys(lists) as Metric[]) {
    const xs = lists[m];
    out[`mean_${m}_ms`] = mean(xs);
    out[`median_${m}_ms`] = percentile(xs, 50);
    out[`std_${m}_ms`] = std(xs);
    for (const p of PERCENTILES) out[`p${p}_${m}_ms`] = percentile(xs, p);
  }
  return out as ServingMetrics;
}
