// Fleet routing, measured against round-robin in the same run, on the
// synthetic model (in this process: 3 prefill workers, 1 decode).
//
// locality  requests drawn from a few long shared prefixes (system prompts),
//           one at a time: the share that reach a prefill which prefilled
//           their prefix among its last CACHED prefixes, the hit rate a
//           prefill prefix cache of that many prompts would see (bench/fleet-gguf.ts measures GGUF prefills
//           that reuse cached prefixes).
// load      one prefill 20x slower than the others, rounds of requests 6 at
//           a time: the time a round takes with 'load' (reported and
//           outstanding load, prefix affinity) / with round-robin (medians
//           over rounds, the policies alternating round by round).
import { type Policy, type Worker, startProxy, startWorker } from '../lib/serving';
import { median } from './stats';

export interface FleetRow {
  policy: Policy;
  /** Share of requests whose prefill had their prefix among its last CACHED. */
  prefixHitRate: number;
  /** Time of a round of requests with one slow prefill, ms: median, min, max over rounds. */
  roundMs: number;
  roundMin: number;
  roundMax: number;
  /** roundMs / round-robin roundMs. */
  ratio: number;
}

export interface FleetResult {
  rows: FleetRow[];
  prefixes: number;
  /** Requests of a round (and of the locality run). */
  requests: number;
  rounds: number;
}

/** Prefixes a prefill's (modelled) prefix cache holds, least recently used out first. */
const CACHED = 4;
const PREFIXES = Array.from({ length: 12 }, (_, i) => `System prompt ${i}: ${'be helpful and exact. '.repeat(30)}`);

async function post(url: string, prompt: string): Promise<number> {
  const t0 = performance.now();
  const r = await fetch(`${url}/v1/completions`, { method: 'POST', body: JSON.stringify({ prompt, max_tokens: 2 }) });
  const text = await r.text();
  if (r.status !== 200) throw new Error(`fleet bench: ${r.status} ${text.slice(0, 200)}`);
  return performance.now() - t0;
}

async function locality(policy: Policy, prefills: Worker[], decode: Worker, n: number): Promise<number> {
  const proxy = await startProxy({
    prefill: prefills.map((w) => w.address),
    decode: [decode.address],
    policy,
    healthIntervalMs: 0,
  });
  const cache = prefills.map((): number[] => []);
  let hits = 0;
  try {
    for (let i = 0; i < n; i++) {
      const p = (i * 7 + (i >> 2)) % PREFIXES.length;
      const before = prefills.map((w) => w.stats.prefills);
      await post(proxy.url, `${PREFIXES[p]} question ${i}`);
      const k = prefills.findIndex((w, j) => w.stats.prefills > before[j]);
      const at = cache[k].indexOf(p);
      if (at >= 0) {
        hits++;
        cache[k].splice(at, 1);
      }
      cache[k].unshift(p);
      cache[k].length = Math.min(cache[k].length, CACHED);
    }
  } finally {
    await proxy.close();
  }
  return hits / n;
}

/** One round: n requests, 6 at a time; its wall time, ms. */
async function round(policy: Policy, prefills: Worker[], decode: Worker, n: number): Promise<number> {
  const proxy = await startProxy({
    prefill: prefills.map((w) => w.address),
    decode: [decode.address],
    policy,
    healthIntervalMs: 0,
  });
  let next = 0;
  const t0 = performance.now();
  try {
    await Promise.all(
      Array.from({ length: 6 }, async () => {
        while (next < n) {
          const i = next++;
          await post(proxy.url, `request ${i} ${'x'.repeat(i % 50)}`);
        }
      }),
    );
    return performance.now() - t0;
  } finally {
    await proxy.close();
  }
}

/** Round-robin and 'load' on the same workers: `n` requests per locality run and per round. */
export async function benchFleet(n: number, rounds: number): Promise<FleetResult> {
  const fast = await Promise.all([0, 1].map(() => startWorker({ blocks: 1024, testHooks: { stallPrefillMs: 5 } })));
  const slow = await startWorker({ blocks: 1024, testHooks: { stallPrefillMs: 100 } });
  const decode = await startWorker({ blocks: 4096 });
  const prefills = [...fast, slow];
  try {
    const policies: Policy[] = ['round-robin', 'load'];
    const hit = new Map<Policy, number>();
    const lat = new Map<Policy, number[]>(policies.map((p) => [p, []]));
    for (const p of policies) hit.set(p, await locality(p, prefills, decode, n));
    // Alternating rounds, so both policies see the same machine.
    for (let r = 0; r < rounds; r++) for (const p of policies) lat.get(p)!.push(await round(p, prefills, decode, n));
    const base = median(lat.get('round-robin')!);
    return {
      prefixes: PREFIXES.length,
      requests: n,
      rounds,
      rows: policies.map((p) => {
        const l = lat.get(p)!;
        return {
          policy: p,
          prefixHitRate: hit.get(p)!,
          roundMs: median(l),
          roundMin: Math.min(...l),
          roundMax: Math.max(...l),
          ratio: median(l) / base,
        };
      }),
    };
  } finally {
    await Promise.all([...prefills, decode].map((w) => w.close()));
  }
}
