// Fleet routing with GGUF prefills that reuse a cached prompt prefix
// (lib/serving/models/llama-prefix.ts): 'load' (prefix affinity) against
// round-robin on the same workers, in this process: 3 prefill workers of the
// generated 'small' model, 3 contexts each (each caches the prompt it last
// evaluated: 9 prompts in all, 3 per prefill), and 1 decode. Requests start
// with one of 6 long shared prefixes (system prompts over 1000 tokens) and
// end with a short question; one at a time, streamed, 2 tokens; the two
// policies take turns request by request (each with prefixes of its own, so
// that no cache helps the other) and see the same machine. Per policy and
// run: the share of prefills that reused a prefix, the share of prompt tokens
// reused, the mean time to first token and the mean prefill time (evaluating
// plus saving the state); ratios to round-robin in the same run.
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
  /** Means over the run's requests, ms. ttftRatio: ttftMs / round-robin's of the same run; prefillRatio likewise. */
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

interface Tally {
  hits: number;
  reused: number;
  tokens: number;
  ttft: number[];
  prefill: number[];
  prompt: number[];
}

/** One run: n requests per policy, the policies taking turns request by request (each its own prefixes). */
async function run(r: number, prefills: Worker[], decode: Worker, n: number): Promise<Map<Policy, Tally>> {
  const policies: Policy[] = ['round-robin', 'load'];
  const proxies = await Promise.all(
    policies.map((policy) =>
      startProxy({ prefill: prefills.map((w) => w.address), decode: [decode.address], policy, healthIntervalMs: 0 }),
    ),
  );
  const sum = (k: 'prefixHits' | 'prefixReusedTokens' | 'prefillEvaluatedTokens' | 'prefillMs') =>
    prefills.reduce((s, w) => s + w.stats[k], 0);
  const out = new Map<Policy, Tally>(
    policies.map((p) => [p, { hits: 0, reused: 0, tokens: 0, ttft: [], prefill: [], prompt: [] }]),
  );
  try {
    for (let i = 0; i < n; i++)
      for (const j of i % 2 === 0 ? [0, 1] : [1, 0]) {
        const t = out.get(policies[j])!;
        const b = [sum('prefixHits'), sum('prefixReusedTokens'), sum('prefillEvaluatedTokens'), sum('prefillMs')];
        const prompt = `${prefix(`/${r}${policies[j]}`, draw(i))} Question ${i}: what comes next?`;
        t.ttft.push((await stream(proxies[j].url, prompt, 2)).ttftMs);
        const reused = sum('prefixReusedTokens') - b[1];
        t.hits += sum('prefixHits') - b[0];
        t.reused += reused;
        t.tokens += reused + sum('prefillEvaluatedTokens') - b[2];
        t.prompt.push(reused + sum('prefillEvaluatedTokens') - b[2]);
        t.prefill.push(sum('prefillMs') - b[3]);
      }
  } finally {
    await Promise.all(proxies.map((p) => p.close()));
  }
  return out;
}

const mean = (a: number[]) => a.reduce((x, y) => x + y, 0) / a.length;

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
    for (let i = 0; i < 3; i++) workers.push(await startWorker({ ...o, parallel: 3 }));
    const decode = await startWorker({ ...o, parallel: 1 });
    workers.push(decode);
    const prefills = workers.slice(0, 3);
    const out: FleetGgufRun[] = [];
    let promptTokens = 0;
    for (let r = 0; r < runs; r++) {
      const got = await run(r, prefills, decode, n);
      const base = got.get('round-robin')!;
      for (const p of ['round-robin', 'load'] as const) {
        const g = got.get(p)!;
        promptTokens = median(g.prompt);
        out.push({
          policy: p,
          hitRate: g.hits / n,
          reusedShare: g.reused / g.tokens,
          ttftMs: mean(g.ttft),
          prefillMs: mean(g.prefill),
          ttftRatio: mean(g.ttft) / mean(base.ttft),
          prefillRatio: mean(g.prefill) / mean(base.prefill),
        });
      }
    }
    return { runs: out, requests: n, prefixes: PREFIXES, promptTokens, batchSize: BATCH };
  } finally {
    await Promise.all(workers.map((w) => w.close()));
  }
}
