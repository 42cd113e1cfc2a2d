// Fleet routing with GGUF prefills that reuse a cached prompt prefix
// (lib/serving/models/llama-prefix.ts): 'load' (prefix affinity) against
// round-robin on the same workers, in this process: 3 prefill workers of the
// generated 'small' model, 2 contexts each (each caches the prompt it last
// evaluated), and 1 decode. Requests start with one of 6 long shared
// prefixes (system prompts over 1000 tokens) and end with a short question;
// one at a time, streamed, 2 tokens. Each run gives each policy its own
// prefixes (no cache helps the other), the order alternating run by run.
// Per policy and run: the share of prefills that reused a prefix, the share
// of prompt tokens reused, the median time to first token and the median
// prefill time (evaluating plus saving the state); ratios to round-robin in
// the same run.
import { createHash } from 'node:crypto';
import * as os from 'node:os';
import { type Policy, type Worker, startProxy, startWorker } from '../lib/serving';
import { modelPath } from '../lib/serving/models/test-models';
import { stream } from './serving';
import { median } from './stats';

export interface FleetGgufRun {
  policy: Policy;
  hitRate: number;
  reusedShare: number;
  ttftMs: number;
  prefillMs: number;
  /** ttftMs / round-robin's ttftMs of the same run; prefillMs likewise. */
  ttftRatio: number;
  prefillRatio: number;
}

export interface FleetGgufResult {
  runs: FleetGgufRun[];
  requests: number;
  prefixes: number;
  /** Prompt tokens of a request (with BOS), median. */
  promptTokens: number;
  batchSize: number;
  note?: string;
}

const PREFIXES = 6;
const BATCH = 512; // node-llama-cpp's default for these contexts: whole batches of it are reused
const WORDS = ['answer', 'briefly', 'cite', 'sources', 'never', 'guess', 'keep', 'units', 'exact', 'and', 'clear'];

/** A system prompt of about 1100 tokens, different from its first character on for each (set, index). */
function prefix(set: string, i: number): string {
  let x = (i + 1) * 2654435761;
  const words: string[] = [];
  for (let w = 0; w < 150; w++) {
    x = (x * 1103515245 + 12345) % 2147483648;
    words.push(WORDS[x % WORDS.length]);
  }
  return `${i}${set} System: ${words.join(' ')}.`;
}

/** The prefix of request i (a fixed pseudo-random draw, the same for both policies). */
function draw(i: number): number {
  return createHash('sha256').update(`request ${i}`).digest()[0] % PREFIXES;
}

async function runPolicy(policy: Policy, set: string, prefills: Worker[], decode: Worker, n: number) {
  const proxy = await startProxy({
    prefill: prefills.map((w) => w.address),
    decode: [decode.address],
    policy,
    healthIntervalMs: 0,
  });
  const sum = (k: 'prefixHits' | 'prefixReusedTokens' | 'prefillEvaluatedTokens' | 'prefillMs') =>
    prefills.reduce((s, w) => s + w.stats[k], 0);
  const ttft: number[] = [];
  const prefill: number[] = [];
  const tokens: number[] = [];
  const hits0 = sum('prefixHits');
  try {
    for (let i = 0; i < n; i++) {
      const before = {
        ms: sum('prefillMs'),
        reused: sum('prefixReusedTokens'),
        evaluated: sum('prefillEvaluatedTokens'),
      };
      const s = await stream(proxy.url, `${prefix(set, draw(i))} Question ${i}: what comes next?`, 2);
      ttft.push(s.ttftMs);
      prefill.push(sum('prefillMs') - before.ms);
      tokens.push(sum('prefixReusedTokens') - before.reused, sum('prefillEvaluatedTokens') - before.evaluated);
    }
  } finally {
    await proxy.close();
  }
  const reused = tokens.filter((_, j) => j % 2 === 0).reduce((a, b) => a + b, 0);
  const all = tokens.reduce((a, b) => a + b, 0);
  const prompt = tokens.filter((_, j) => j % 2 === 0).map((r, j) => r + tokens[2 * j + 1]);
  return {
    hitRate: (sum('prefixHits') - hits0) / n,
    reusedShare: reused / all,
    ttftMs: median(ttft),
    prefillMs: median(prefill),
    promptTokens: median(prompt),
  };
}

/** Round-robin and 'load' on the same GGUF workers, `runs` times, `n` requests each. */
export async function benchFleetGguf(n: number, runs: number): Promise<FleetGgufResult> {
  let gguf: string;
  try {
    require.resolve('node-llama-cpp');
    gguf = modelPath('small');
  } catch {
    return {
      runs: [],
      requests: 0,
      prefixes: PREFIXES,
      promptTokens: 0,
      batchSize: BATCH,
      note: 'skipped: node-llama-cpp is not installed',
    };
  }
  const o = { model: gguf, threads: os.availableParallelism(), contextSize: 2048, blocks: 512 };
  const workers: Worker[] = [];
  try {
    for (let i = 0; i < 3; i++) workers.push(await startWorker({ ...o, parallel: 2 }));
    const decode = await startWorker({ ...o, parallel: 1 });
    workers.push(decode);
    const prefills = workers.slice(0, 3);
    const out: FleetGgufRun[] = [];
    let promptTokens = 0;
    for (let r = 0; r < runs; r++) {
      const order: Policy[] = r % 2 === 0 ? ['round-robin', 'load'] : ['load', 'round-robin'];
      const got = new Map<Policy, Awaited<ReturnType<typeof runPolicy>>>();
      for (const p of order) got.set(p, await runPolicy(p, `/${r}${p}`, prefills, decode, n));
      const base = got.get('round-robin')!;
      for (const p of ['round-robin', 'load'] as const) {
        const g = got.get(p)!;
        promptTokens = g.promptTokens;
        out.push({
          policy: p,
          hitRate: g.hitRate,
          reusedShare: g.reusedShare,
          ttftMs: g.ttftMs,
          prefillMs: g.prefillMs,
          ttftRatio: g.ttftMs / base.ttftMs,
          prefillRatio: g.prefillMs / base.prefillMs,
        });
      }
    }
    return { runs: out, requests: n, prefixes: PREFIXES, promptTokens, batchSize: BATCH };
  } finally {
    await Promise.all(workers.map((w) => w.close()));
  }
}
