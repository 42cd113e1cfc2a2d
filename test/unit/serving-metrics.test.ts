// The serving figures as vLLM's serving benchmark defines them (bench/serving-metrics.ts).
// Expected values come from numpy: np.percentile(xs, p) (linear), np.std (ddof=0).
import { expect, it } from 'vitest';
import { percentile, type RequestTiming, servingMetrics, tpotMs } from '../../bench/serving-metrics';

it('percentile interpolates linearly between closest ranks, as numpy does by default', () => {
  expect(percentile([1, 2, 3, 4], 50)).toBeCloseTo(2.5, 12);
  expect(percentile([1, 2, 3, 4], 90)).toBeCloseTo(3.7, 12);
  expect(percentile([1, 2, 3, 4], 99)).toBeCloseTo(3.97, 12);
  // Unsorted input, repeated values.
  expect(percentile([3, 1, 4, 1, 5, 9, 2, 6], 50)).toBeCloseTo(3.5, 12);
  expect(percentile([3, 1, 4, 1, 5, 9, 2, 6], 90)).toBeCloseTo(6.9, 12);
  expect(percentile([3, 1, 4, 1, 5, 9, 2, 6], 99)).toBeCloseTo(8.79, 12);
  expect(percentile([10, 20], 90)).toBeCloseTo(19, 12);
  expect(percentile([5], 99)).toBe(5);
  expect(percentile([2, 8], 0)).toBe(2);
  expect(percentile([2, 8], 100)).toBe(8);
});

it('percentile of nothing is 0 (vLLM: np.percentile(xs or 0, p)); a p outside [0, 100] is refused', () => {
  expect(percentile([], 99)).toBe(0);
  expect(() => percentile([1], 101)).toThrow(RangeError);
  expect(() => percentile([1], Number.NaN)).toThrow(RangeError);
});

const req = (ttftMs: number, itlMs: number[], outputTokens = itlMs.length + 1): RequestTiming => ({
  ttftMs,
  e2elMs: ttftMs + itlMs.reduce((a, x) => a + x, 0),
  outputTokens,
  itlMs,
});

it('TPOT excludes the first token and is undefined with one output token', () => {
  expect(tpotMs(req(100, [10, 20, 30]))).toBeCloseTo(20, 12); // (160 - 100) / (4 - 1)
  expect(tpotMs(req(100, []))).toBeUndefined();
  // Two tokens in one chunk: one gap seen, two decode tokens after the first.
  expect(tpotMs(req(100, [30], 3))).toBeCloseTo(15, 12);
});

it('servingMetrics: TTFT per request, TPOT per multi-token request, ITL gaps pooled, throughput over the duration', () => {
  const m = servingMetrics([req(100, [10, 20, 30]), req(200, [40]), req(300, [])], 2);
  expect(m.completed).toBe(3);
  expect(m.total_output_tokens).toBe(4 + 2 + 1);
  expect(m.request_throughput).toBeCloseTo(1.5, 12);
  expect(m.output_throughput).toBeCloseTo(3.5, 12);
  expect(m.mean_ttft_ms).toBeCloseTo(200, 12);
  expect(m.median_ttft_ms).toBeCloseTo(200, 12);
  expect(m.p90_ttft_ms).toBeCloseTo(280, 12);
  expect(m.std_ttft_ms).toBeCloseTo(81.64965809277261, 9);
  // TPOT: 20 and 40; the one-token request is left out, not counted as 0.
  expect(m.mean_tpot_ms).toBeCloseTo(30, 12);
  expect(m.p99_tpot_ms).toBeCloseTo(39.8, 12);
  // ITL: 10, 20, 30, 40 pooled across requests.
  expect(m.median_itl_ms).toBeCloseTo(25, 12);
  expect(m.p90_itl_ms).toBeCloseTo(37, 12);
  expect(m.mean_e2el_ms).toBeCloseTo((160 + 240 + 300) / 3, 12);
});

it('servingMetrics of no requests, or of one-token requests only, is zeros, not NaN', () => {
  const none = servingMetrics([], 0);
  for (const [k, v] of Object.entries(none)) expect([k, v]).toEqual([k, 0]);
  const one = servingMetrics([req(50, [])], 0.1);
  expect(one.mean_tpot_ms).toBe(0);
  expect(one.p99_itl_ms).toBe(0);
  expect(one.p99_ttft_ms).toBe(50);
  expect(one.request_throughput).toBeCloseTo(10, 12);
});
