// A closed-loop HTTP load for the proxy bench: `concurrency` clients on
// keep-alive connections, each sending its next request when its last one is
// answered, every answer checked against what the fake decode says.
import * as http from 'node:http';
import { FAKE_MODEL, wrongAnswer } from './fake-workers';

export interface LoadResult {
  seconds: number;
  /** Per request, ms. */
  latencies: number[];
  /** Answers that were not the fake decode's (first 5 reasons kept). */
  wrong: number;
  reasons: string[];
}

/** One POST of a JSON body; the status and the whole answer. */
export function post(agent: http.Agent, url: URL, body: string): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      {
        agent,
        host: url.hostname,
        port: url.port,
        path: url.pathname,
        method: 'POST',
        headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
      },
      (res) => {
        const parts: Buffer[] = [];
        res.on('data', (c: Buffer) => parts.push(c));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, text: Buffer.concat(parts).toString('utf8') }));
        res.on('error', reject);
      },
    );
    req.on('error', reject);
    req.end(body);
  });
}

/** A request's prompt: unique, so that an answer given to the wrong request is caught. */
export function prompt(round: string, i: number): string {
  return `${round} request ${i}: the quick brown fox jumps over the lazy dog`;
}

export function completionBody(p: string): string {
  return JSON.stringify({ model: FAKE_MODEL, prompt: p, max_tokens: 16, temperature: 0 });
}

/** `n` requests through `ask` (which answers one prompt), `concurrency` at a time. */
export async function runLoad(
  n: number,
  concurrency: number,
  tag: string,
  ask: (p: string) => Promise<{ status: number; text: string }>,
): Promise<LoadResult> {
  const latencies: number[] = [];
  const reasons: string[] = [];
  let wrong = 0;
  let next = 0;
  const deadline = Date.now() + 120_000;
  const t0 = performance.now();
  const client = async () => {
    while (next < n && Date.now() < deadline) {
      const p = prompt(tag, next++);
      const s = performance.now();
      let why: string | undefined;
      try {
        const a = await ask(p);
        why = wrongAnswer(p, a.status, a.text);
      } catch (e) {
        why = (e as Error).message;
      }
      latencies.push(performance.now() - s);
      if (why) {
        wrong++;
        if (reasons.length < 5) reasons.push(why);
      }
    }
  };
  await Promise.all(Array.from({ length: concurrency }, client));
  return { seconds: (performance.now() - t0) / 1000, latencies, wrong, reasons };
}

/** The client calls the prefill, then the decode with the params it returned (no proxy). */
export function directAsk(
  agent: http.Agent,
  prefill: string,
  decode: string,
): (p: string) => Promise<{ status: number; text: string }> {
  const pre = new URL(`${prefill}/v1/completions`);
  const dec = new URL(`${decode}/v1/completions`);
  return async (p) => {
    const body = { model: FAKE_MODEL, prompt: p, max_tokens: 16, temperature: 0 };
    const a = await post(
      agent,
      pre,
      JSON.stringify({
        ...body,
        max_tokens: 1,
        stream: false,
        kv_transfer_params: { do_remote_decode: true, do_remote_prefill: false },
      }),
    );
    if (a.status !== 200) return a;
    const kv = (JSON.parse(a.text) as { kv_transfer_params?: unknown }).kv_transfer_params;
    return post(agent, dec, JSON.stringify({ ...body, kv_transfer_params: kv }));
  };
}

/** Through a proxy at `url`. */
export function proxyAsk(agent: http.Agent, url: string): (p: string) => Promise<{ status: number; text: string }> {
  const u = new URL(`${url}/v1/completions`);
  return (p) => post(agent, u, completionBody(p));
}
