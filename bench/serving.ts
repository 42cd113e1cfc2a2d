// A real model served two ways on the same prompts: disaggregated (a prefill
// worker and a decode worker; the KV state moves by nixl-node) and
// co-located (one worker in both pools: the state goes into its own blocks
// and back, nothing moves). Both behind the proxy, in this process, one
// streamed greedy request at a time, configurations alternating request by
// request so that both see the same machine. Reported: time to first token
// and decode tokens/s (medians, ranges, ratios to co-located), the share of
// the disaggregated time to first token spent saving, moving and loading
// the KV, KV bytes per token, and whether both answered the same text; and
// per configuration the figures vLLM's serving benchmark gives (TTFT, TPOT,
// ITL and E2EL mean/median/std/p50/p90/p99, request and output-token
// throughput: bench/serving-metrics.ts), under vLLM's JSON names.
import * as os from 'node:os';
import { type Worker, startProxy, startWorker } from '../lib/serving';
import { modelPath } from '../lib/serving/models/test-models';
import type { Panel } from './svg';
import { PERCENTILES, type RequestTiming, type ServingMetrics, servingMetrics } from './serving-metrics';
import { median } from './stats';

/** The earlier keys, then vLLM's (mean_ttft_ms, p99_itl_ms, request_throughput, ...: ServingMetrics). */
export type ServingRow = ServingRowBase & ServingMetrics;

interface ServingRowBase {
  config: 'co-located' | 'disaggregated';
  /** Median, min and max TTFT, ms. */
  ttftMs: number;
  ttftMin: number;
  ttftMax: number;
  /** Median over requests of (output tokens - 1) / (E2EL - TTFT): 1000 / the request's TPOT. */
  decodeTokensPerSecond: number;
  /** TTFT / co-located TTFT; tokens/s / co-located tokens/s. */
  ttftRatio: number;
  decodeRatio: number;
}

export interface ServingResult {
  rows: ServingRow[];
  model: string;
  requests: number;
  /** Disaggregated: shares of TTFT (medians over requests). */
  shareSave: number;
  shareMove: number;
  shareLoad: number;
  kvBytesPerToken: number;
  /** Requests whose two answers were the same text. */
  identical: number;
  note?: string;
}

interface Sample extends RequestTiming {
  tokensPerSecond: number;
  /** Send to the end of the stream, ms: what the request held the server for. */
  wallMs: number;
  text: string;
  info: Record<string, number>;
}

/** One streamed request: time to the first text, the gaps between text chunks, tokens/s after the first. */
export async function stream(url: string, prompt: string, maxTokens: number): Promise<Sample> {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      prompt,
      max_tokens: maxTokens,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    }),
  });
  if (!res.ok || !res.body) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let first = 0;
  let last = 0;
  const itlMs: number[] = [];
  let text = '';
  let tokens = 0;
  let promptTokens = 0;
  let info: Record<string, number> = {};
  let buf = '';
  const decoder = new TextDecoder();
  for await (const part of res.body) {
    buf += decoder.decode(part as Uint8Array, { stream: true });
    let nl = buf.indexOf('\n\n');
    while (nl >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 2);
      nl = buf.indexOf('\n\n');
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const c = JSON.parse(line.slice(6));
      if (c.error) throw new Error(c.error.message);
      const piece = c.choices?.[0]?.text ?? '';
      if (piece) {
        const now = performance.now() - t0;
        if (!first) first = now;
        else itlMs.push(now - last);
        last = now;
      }
      text += piece;
      if (c.usage) {
        tokens = c.usage.completion_tokens;
        promptTokens = c.usage.prompt_tokens ?? 0;
      }
      if (c.nixl_node) info = c.nixl_node;
    }
  }
  return {
    ttftMs: first,
    e2elMs: last,
    outputTokens: tokens,
    promptTokens,
    itlMs,
    tokensPerSecond: tokens > 1 ? ((tokens - 1) * 1000) / (last - first) : 0,
    wallMs: performance.now() - t0,
    text,
    info,
  };
}

export async function benchServing(requests: number, maxTokens: number): Promise<ServingResult> {
  let gguf: string;
  try {
    require.resolve('node-llama-cpp');
    gguf = modelPath('small');
  } catch {
    return {
      rows: [],
      model: '',
      requests: 0,
      shareSave: 0,
      shareMove: 0,
      shareLoad: 0,
      kvBytesPerToken: 0,
      identical: 0,
      note: 'skipped: node-llama-cpp is not installed',
    };
  }
  // Every worker gets every core: one request runs at a time.
  const o = { model: gguf, threads: os.availableParallelism(), contextSize: 2048, parallel: 1, blocks: 512 };
  const workers: Worker[] = [];
  const closers: Array<() => Promise<unknown>> = [];
  try {
    const [prefill, decode, both] = await Promise.all([startWorker(o), startWorker(o), startWorker(o)]);
    workers.push(prefill, decode, both);
    for (const w of workers) closers.push(() => w.close());
    const disagg = await startProxy({ prefill: [prefill.address], decode: [decode.address], healthIntervalMs: 0 });
    const colo = await startProxy({ prefill: [both.address], decode: [both.address], healthIntervalMs: 0 });
    closers.unshift(
      () => disagg.close(),
      () => colo.close(),
    );
    const words = 'the river runs through a quiet valley where the rain falls on old stones'.split(' ');
    // 150 to 600 tokens: KV states of about 1 to 5 MiB on this model.
    const prompt = (i: number) =>
      Array.from({ length: 30 + ((i * 37) % 90) }, (_, k) => words[(i + k) % words.length]).join(' ');
    await stream(disagg.url, prompt(0), 4); // warm both paths
    await stream(colo.url, prompt(0), 4);
    const got: Record<ServingRow['config'], Sample[]> = { 'co-located': [], disaggregated: [] };
    const shares = { save: [] as number[], move: [] as number[], load: [] as number[] };
    const perToken: number[] = [];
    let identical = 0;
    for (let i = 0; i < requests; i++) {
      const p = prompt(i + 1);
      const saveBefore = prefill.stats.kvSaveMs;
      const d = await stream(disagg.url, p, maxTokens);
      const c = await stream(colo.url, p, maxTokens);
      got.disaggregated.push(d);
      got['co-located'].push(c);
      if (d.text === c.text) identical++;
      shares.save.push((prefill.stats.kvSaveMs - saveBefore) / d.ttftMs);
      shares.move.push((d.info.kv_pull_ms ?? 0) / d.ttftMs);
      shares.load.push((d.info.kv_load_ms ?? 0) / d.ttftMs);
      if (d.info.kv_tokens_loaded) perToken.push((d.info.kv_state_bytes ?? 0) / d.info.kv_tokens_loaded);
    }
    const base = got['co-located'];
    const rows = (['co-located', 'disaggregated'] as const).map((config): ServingRow => {
      const s = got[config];
      const ttft = s.map((x) => x.ttftMs);
      return {
        config,
        ttftMs: round(median(ttft)),
        ttftMin: round(Math.min(...ttft)),
        ttftMax: round(Math.max(...ttft)),
        decodeTokensPerSecond: round(median(s.map((x) => x.tokensPerSecond))),
        ttftRatio: round(median(s.map((x, i) => x.ttftMs / base[i].ttftMs))),
        decodeRatio: round(median(s.map((x, i) => x.tokensPerSecond / base[i].tokensPerSecond))),
        ...roundAll(
          // One request at a time, the configurations alternating: a configuration's duration is the sum of its own requests' times.
          servingMetrics(s, s.reduce((a, x) => a + x.wallMs, 0) / 1000),
        ),
      };
    });
    return {
      rows,
      model: 'small (generated llama GGUF, 8 layers, 256 wide)',
      requests,
      shareSave: round(median(shares.save)),
      shareMove: round(median(shares.move)),
      shareLoad: round(median(shares.load)),
      kvBytesPerToken: Math.round(median(perToken)),
      identical,
    };
  } finally {
    for (const c of closers) await c();
  }
}

function round(x: number): number {
  return Math.round(x * 1000) / 1000;
}

function roundAll<T extends Record<string, number>>(o: T): T {
  return Object.fromEntries(Object.entries(o).map(([k, v]) => [k, round(v)])) as T;
}

const COLORS: Record<ServingRow['config'], string> = { 'co-located': '#4c78a8', disaggregated: '#f58518' };

/** vLLM's serving figures as a table: a row per configuration and metric, the columns `vllm bench serve` gives. */
export function servingFigures(rows: readonly ServingRow[]): { head: string[]; cells: Array<Array<string | number>> } {
  const head = ['config', 'ms', 'mean', 'median', 'std', ...PERCENTILES.map((p) => `p${p}`)];
  const cells = rows.flatMap((r) =>
    (['ttft', 'tpot', 'itl', 'e2el'] as const).map((m) => [
      r.config,
      m.toUpperCase(),
      r[`mean_${m}_ms`],
      r[`median_${m}_ms`],
      r[`std_${m}_ms`],
      ...PERCENTILES.map((p) => r[`p${p}_${m}_ms`]),
    ]),
  );
  return { head, cells };
}

/** The chart's serving panels: TTFT, TPOT and ITL percentiles (ms), then the two throughputs; a colour per configuration. */
export function servingPanels(rows: readonly ServingRow[]): Panel[] {
  const pct = (m: 'ttft' | 'tpot' | 'itl', name: string) =>
    rows.flatMap((r) =>
      PERCENTILES.map((p) => ({
        label: `${r.config} ${name} p${p}`,
        value: r[`p${p}_${m}_ms`],
        color: COLORS[r.config],
      })),
    );
  const per = (k: 'request_throughput' | 'output_throughput') =>
    rows.map((r) => ({ label: r.config, value: r[k], color: COLORS[r.config] }));
  return [
    { title: 'Serving a real model: time to first token, ms (lower is better)', bars: pct('ttft', 'TTFT') },
    {
      title: 'Serving: time per output token (excl. 1st) and inter-token latency, ms (lower is better)',
      bars: [...pct('tpot', 'TPOT'), ...pct('itl', 'ITL')],
    },
    { title: 'Serving: request throughput, req/s (one request at a time)', bars: per('request_throughput') },
    { title: 'Serving: output token throughput, tok/s', bars: per('output_throughput') },
  ];
}
