// The serving bench's client (bench/serving.ts stream()) against the proxy and
// synthetic workers: what it records per request is what vLLM's serving
// benchmark records (TTFT, a gap per later text chunk, E2EL, usage tokens), so
// that bench/serving-metrics.ts gets consistent inputs.
import { afterAll, expect, it } from 'vitest';
import { stream } from '../../bench/serving';
import { servingMetrics } from '../../bench/serving-metrics';
import { type ServingProxy, type Worker, startProxy, startWorker } from '../../lib/serving';

const closers: Array<() => Promise<unknown>> = [];
afterAll(async () => {
  for (const c of closers.reverse()) await c();
});

it('a streamed request gives TTFT <= E2EL, one ITL gap per later text chunk, and usage tokens', async () => {
  const prefill: Worker = await startWorker({ name: 'p', blocks: 256 });
  closers.push(() => prefill.close());
  const decode: Worker = await startWorker({ name: 'd', blocks: 256 });
  closers.push(() => decode.close());
  const proxy: ServingProxy = await startProxy({
    prefill: [prefill.address],
    decode: [decode.address],
    healthIntervalMs: 0,
  });
  closers.push(() => proxy.close());
  const got = [];
  for (const maxTokens of [1, 6]) {
    const s = await stream(proxy.url, 'the river runs through a quiet valley', maxTokens);
    expect(s.outputTokens).toBe(maxTokens);
    expect(s.promptTokens).toBeGreaterThan(0);
    expect(s.ttftMs).toBeGreaterThan(0);
    expect(s.e2elMs).toBeGreaterThanOrEqual(s.ttftMs);
    expect(s.wallMs).toBeGreaterThanOrEqual(s.e2elMs);
    // Gaps sum to E2EL - TTFT; at most one gap per token after the first (a chunk may carry several).
    expect(s.itlMs.length).toBeLessThanOrEqual(maxTokens - 1);
    expect(s.itlMs.reduce((a, x) => a + x, 0)).toBeCloseTo(s.e2elMs - s.ttftMs, 6);
    got.push(s);
  }
  const m = servingMetrics(got, 1);
  expect(m.completed).toBe(2);
  expect(m.total_output_tokens).toBe(7);
  // TPOT only from the 6-token request.
  expect(m.mean_tpot_ms).toBeCloseTo((got[1].e2elMs - got[1].ttftMs) / 5, 9);
});
