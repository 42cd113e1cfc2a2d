// Fleet routing with GGUF prefills that reuse a cached prompt prefix
// (lib/serving/models/llama/prefix.ts): 'load' (prefix affinity) and
// 'precise' (the proxy follows the prefills' KV events, tokenizing prompts
// with the prefills' GGUF vocabulary loaded on the proxy) against round-robin, in this process: each
// policy routes over 3 prefill workers of its own, configured alike, of the
// generated 'small' model, 3 contexts each (each caches the prompt it last
// evaluated: 9 prompts in all, 3 per prefill), and all share 1 decode. Own
// prefills, because shared ones let one policy's prompts evict another's
// prefixes: what a policy could reuse would then depend on the others. Requests start
// with one of 6 long shared prefixes (system prompts over 1000 tokens) and
// end with a short question; one at a time, streamed, 2 tokens; the three
// policies take turns request by request (each with prefixes of its own, so
// that no cache helps another) and see the same machine. Before the runs
// every prefill makes its contexts and its pull connection (warmUp), so no
// policy pays more of that inside its measured requests.
// Every prefill publishes KV events (ipc:// sockets in a temp dir); only the
// precise proxy follows them. Per policy and run: the share of prefills that
// reused a prefix, of all and of those that could (some prefill held a whole
// batch of the prompt when it was sent: what the workers announce, read from
// the workers themselves, not from the proxy's index), the share of prompt
// tokens reused, mean and p99 time to first token and the mean prefill time
// (evaluating plus saving the state); ratios to round-robin in the same run.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { type Policy, type Worker, startProxy, startWorker } from '../lib/serving';
import { blockDigests, noneHash, wireHash } from '../lib/serving/worker/kv-events/block-hash';
import { modelPath } from '../lib/serving/models/test-models';
import { stream } from './serving';
import { median, percentile } from './stats';

export interface FleetGgufRun {
  policy: Policy;
  hitRate: number;
  /** Prefills that reused a prefix / requests some prefill held a whole batch of when sent. */
  possibleHitRate: number;
  /** Requests some prefill held a whole batch of when sent. */
  possible: number;
  /** Tokens reused / the most any prefill held of each prompt when it was sent. */
  possibleReusedShare: number;
  reusedShare: number;
  ttftMs: number;
  ttftP99Ms: number;
  prefillMs: number;
  /** Means over the run's requests, ms. ttftRatio: ttftMs / round-robin's of the same run; prefillRatio likewise. */
  ttftRatio: number;
  prefillRatio: number;
  /** Median TTFT of the requests that reused a prefix / of those that did not (0 without both): what a hit costs. */
  hitCost: number;
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
/**
 * The prefills' batch (`--batch-size`): whole batches of it are what a hit
 * reuses (lib/serving/models/llama/prefix.ts), so a hit evaluates the part
 * of the shared prefix past its last whole batch as well as its own
 * question. At node-llama-cpp's default of 512 that was 243 of the 1267
 * tokens, and a hit cost about 0.27 of a miss; at 128 it is under 128 (vLLM
 * reuses 16-token blocks), and a 1266-token miss takes about 3% more CPU
 * time than at 512 (64: 13%, 32: twice as much; docs/fleet.md). An operator
 * who wants prefix reuse chooses it; every policy runs with the same one.
 */
const BATCH = 128;
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

/**
 * Request i of run r for the policy at index j: its policy's own prefix
 * (tagged by index, so every policy's prompts are as long as the others':
 * tagged by name they differed by up to 7 tokens, which moves where the
 * shared prefix ends against the batches) and a question.
 */
export function promptOf(r: number, j: number, i: number): string {
  return `${prefix(`/${r}p${j}`, draw(i))} Question ${i}: what comes next?`;
}

/** The prefix of request i (a fixed pseudo-random draw, the same for every policy). */
function draw(i: number): number {
  return createHash('sha256').update(`request ${i}`).digest()[0] % PREFIXES;
}

interface Tally {
  hits: number;
  possible: number;
  possibleTokens: number;
  reused: number;
  tokens: number;
  ttft: number[];
  /** Per request: whether its prefill reused a prefix. */
  hit: boolean[];
  prefill: number[];
  prompt: number[];
}

export const POLICIES: Policy[] = ['round-robin', 'load', 'precise'];

/** The prompt's ids as the prefills evaluate it (a completion's, with BOS): their own /tokenize. */
async function tokensOf(worker: Worker, prompt: string): Promise<number[]> {
  const r = await fetch(`${worker.address}/tokenize`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt }),
  });
  if (!r.ok) throw new Error(`/tokenize: HTTP ${r.status}: ${await r.text()}`);
  return ((await r.json()) as { tokens: number[] }).tokens;
}

/** The most tokens of `tokens` (whole batches from the start) that one prefill announces it holds now. */
function heldTokens(prefills: Worker[], tokens: number[]): number {
  const chain = blockDigests(tokens, BATCH, noneHash()).map(wireHash);
  let most = 0;
  for (const w of prefills) {
    const held = new Set(w.kvEvents?.announced() ?? []);
    let n = 0;
    while (n < chain.length && held.has(chain[n])) n++;
    most = Math.max(most, n * BATCH);
  }
  return most;
}

/** One run: n requests per policy, the policies taking turns request by request (each its own prefixes). */
async function run(
  r: number,
  sets: Map<Policy, Worker[]>,
  decode: Worker,
  n: number,
  gguf: string,
): Promise<Map<Policy, Tally>> {
  const endpoints = Object.fromEntries(
    sets.get('precise')!.map((w) => {
      const info = w.kvEvents?.info;
      if (!info) throw new Error(`${w.address} publishes no KV events`);
      return [
        w.address,
        info.replay_endpoint ? { pub: info.endpoint, replay: info.replay_endpoint } : { pub: info.endpoint },
      ];
    }),
  );
  const proxies = await Promise.all(
    POLICIES.map((policy) =>
      startProxy({
        prefill: sets.get(policy)!.map((w) => w.address),
        decode: [decode.address],
        policy,
        healthIntervalMs: 0,
        ...(policy === 'precise' ? { kvEvents: { endpoints, blockSize: BATCH, tokenizer: { gguf } } } : {}),
      }),
    ),
  );
  const sum = (prefills: Worker[], k: 'prefixHits' | 'prefixReusedTokens' | 'prefillEvaluatedTokens' | 'prefillMs') =>
    prefills.reduce((s, w) => s + w.stats[k], 0);
  const out = new Map<Policy, Tally>(
    POLICIES.map((p) => [
      p,
      { hits: 0, possible: 0, possibleTokens: 0, reused: 0, tokens: 0, ttft: [], hit: [], prefill: [], prompt: [] },
    ]),
  );
  try {
    for (let i = 0; i < n; i++)
      for (let k = 0; k < POLICIES.length; k++) {
        const j = (i + k) % POLICIES.length; // each policy goes first, second and last in turn
        const t = out.get(POLICIES[j])!;
        const prefills = sets.get(POLICIES[j])!;
        const prompt = promptOf(r, j, i);
        const held = heldTokens(prefills, await tokensOf(prefills[0], prompt));
        const now = () =>
          (['prefixHits', 'prefixReusedTokens', 'prefillEvaluatedTokens', 'prefillMs'] as const).map((k) =>
            sum(prefills, k),
          );
        const b = now();
        t.ttft.push((await stream(proxies[j].url, prompt, 2)).ttftMs);
        const a = now();
        const reused = a[1] - b[1];
        if (held > 0) t.possible++;
        t.possibleTokens += held;
        t.hits += a[0] - b[0];
        t.hit.push(a[0] > b[0]);
        t.reused += reused;
        t.tokens += reused + a[2] - b[2];
        t.prompt.push(reused + a[2] - b[2]);
        t.prefill.push(a[3] - b[3]);
      }
  } finally {
    await Promise.all(proxies.map((p) => p.close()));
  }
  return out;
}

/**
 * Every prefill starts as the others do: its 3 contexts made and its pull
 * connection to the decode set up (else whichever policy spreads prompts
 * wider pays more of that inside its measured requests), the decode's
 * context made, and nothing cached (short prompts leave no whole batch).
 */
async function warmUp(sets: Map<Policy, Worker[]>, decode: Worker): Promise<void> {
  for (const w of [...sets.values()].flat()) {
    const proxy = await startProxy({ prefill: [w.address], decode: [decode.address], healthIntervalMs: 0 });
    try {
      await Promise.all([0, 1, 2].map((k) => stream(proxy.url, `warm up ${k}`, 1)));
    } finally {
      await proxy.close();
    }
    if (w.kvEvents?.announced().length) throw new Error(`${w.address} kept a warm-up prompt`);
  }
}

const mean = (a: number[]) => a.reduce((x, y) => x + y, 0) / a.length;

function hitCost(t: Tally): number {
  const hits = t.ttft.filter((_, i) => t.hit[i]);
  const misses = t.ttft.filter((_, i) => !t.hit[i]);
  // Medians: a shared machine's stalls land on a few requests and would decide a ratio of means of 6 misses.
  return hits.length && misses.length ? median(hits) / median(misses) : 0;
}

/** Round-robin, 'load' and 'precise' on the same GGUF workers, `runs` times, `n` requests each. */
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
  const o = { model: gguf, threads: os.availableParallelism(), contextSize: 2048, blocks: 512, batchSize: BATCH };
  const workers: Worker[] = [];
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-prefix-bench-'));
  try {
    const sets = new Map<Policy, Worker[]>();
    for (const p of POLICIES) {
      const set: Worker[] = [];
      for (let i = 0; i < 3; i++) {
        const kvEvents = {
          enable_kv_cache_events: true,
          endpoint: `ipc://${dir}/${p}-${i}.pub`,
          replay_endpoint: `ipc://${dir}/${p}-${i}.replay`,
        };
        const w = await startWorker({ ...o, parallel: 3, kvEvents });
        // What counts as held (heldTokens) and what the precise proxy hashes must be the blocks the prefill announces.
        if (w.kvEvents?.info.block_size !== BATCH)
          throw new Error(`the prefill announces blocks of ${w.kvEvents?.info.block_size} tokens, not ${BATCH}`);
        workers.push(w);
        set.push(w);
      }
      sets.set(p, set);
    }
    const decode = await startWorker({ ...o, parallel: 1 });
    workers.push(decode);
    await warmUp(sets, decode);
    const out: FleetGgufRun[] = [];
    let promptTokens = 0;
    for (let r = 0; r < runs; r++) {
      const got = await run(r, sets, decode, n, gguf);
      const base = got.get('round-robin')!;
      for (const p of POLICIES) {
        const g = got.get(p)!;
        promptTokens = median(g.prompt);
        out.push({
          policy: p,
          hitRate: g.hits / n,
          possible: g.possible,
          possibleHitRate: g.possible ? g.hits / g.possible : 0,
          possibleReusedShare: g.possibleTokens ? g.reused / g.possibleTokens : 0,
          reusedShare: g.reused / g.tokens,
          ttftMs: mean(g.ttft),
          ttftP99Ms: percentile(g.ttft, 99),
          prefillMs: mean(g.prefill),
          ttftRatio: mean(g.ttft) / mean(base.ttft),
          prefillRatio: mean(g.prefill) / mean(base.prefill),
          hitCost: hitCost(g),
        });
      }
    }
    return { runs: out, requests: n, prefixes: PREFIXES, promptTokens, batchSize: BATCH };
  } finally {
    await Promise.all(workers.map((w) => w.close()));
    fs.rmSync(dir, { recursive: true, force: true });
  }
}
