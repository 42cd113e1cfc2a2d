// A full KV cache queues requests instead of failing them (vLLM's scheduler
// keeps them waiting, num_requests_waiting): many concurrent requests whose
// blocks exceed the caches all answer right through the proxy (pull over HTTP
// and ZeroMQ, push); a request bigger than the whole cache is a 400 at once;
// a wait past kvWaitMs is a 503 with Retry-After (never a 502); a client that
// goes away leaves the queue; waiters are served strictly in order.
import { afterEach, describe, expect, it } from 'vitest';
import { prefillRequestParams } from '../../lib/handshake/wire';
import { type Worker, startWorker } from '../../lib/serving';
import { BlockPool } from '../../lib/serving/worker/blocks';
import { serveTrio } from '../helpers';
import { retryAfterHeader } from '../../lib/serving/api/errors';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
// biome-ignore lint/suspicious/noExplicitAny: answers read as JSON
type Json = Record<string, any>;

async function post(url: string, body: unknown, signal?: AbortSignal) {
  const r = await fetch(url, { method: 'POST', body: JSON.stringify(body), signal });
  const text = await r.text();
  return { status: r.status, text, headers: r.headers };
}

/** The answer's text, whole or streamed, completion or chat. */
function textOf(raw: string, stream: boolean): string {
  const one = (j: Json) => j.choices?.[0]?.text ?? j.choices?.[0]?.message?.content ?? j.choices?.[0]?.delta?.content;
  if (!stream) return one(JSON.parse(raw));
  let t = '';
  for (const l of raw.split('\n').filter((x) => x.startsWith('data: {'))) t += one(JSON.parse(l.slice(6))) ?? '';
  return t;
}

async function until(f: () => boolean | Promise<boolean>, ms = 10_000) {
  const end = performance.now() + ms;
  while (!(await f())) {
    if (performance.now() > end) throw new Error('condition not met in time');
    await sleep(20);
  }
}

const health = async (w: Worker) => (await (await fetch(`${w.address}/health`)).json()) as Json;

/** A prefill's hold, made straight at the worker and never read: its blocks stay taken until released. */
async function hold(w: Worker, prompt: string, signal?: AbortSignal) {
  const r = await post(
    `${w.address}/v1/completions`,
    { prompt, max_tokens: 1, kv_transfer_params: prefillRequestParams() },
    signal,
  );
  return {
    status: r.status,
    id: r.status === 200 ? (JSON.parse(r.text).kv_transfer_params.remote_request_id as string) : '',
  };
}
/** Passes an answer on, noting in `order` that it came. */
const noted =
  (order: string[], name: string) =>
  <T>(r: T): T => {
    order.push(name);
    return r;
  };
const release = (w: Worker, id: string) => post(`${w.address}/v1/kv/release`, { remote_request_id: id });

const CASES = [
  { transport: 'http', kvMode: 'pull' },
  { transport: 'zmq', kvMode: 'pull' },
  { transport: 'http', kvMode: 'push' },
] as const;

describe.each(CASES)('a full KV cache queues ($transport, $kvMode)', ({ transport, kvMode }) => {
  it('24 concurrent requests wanting 4x the blocks all answer 200, right, and every block comes back', async () => {
    const ref = await startWorker({ transport: 'http' });
    closers.push(() => ref.close());
    // 48 blocks each side; each request wants 5 to 12: about 200 at once.
    const { prefill, decode, proxy } = await serveTrio(closers, {
      transport,
      prefill: { blocks: 48, kvMode },
      decode: { blocks: 48, kvMode },
      proxy: { kvMode, timeoutMs: { prefill: 20_000, decode: 20_000 } },
    });
    const reqs = Array.from({ length: 24 }, (_, i) => {
      const chat = i % 2 === 1;
      const stream = i % 4 >= 2;
      const text = `${i} ${'queue me '.repeat(8 + ((i * 7) % 13))}`;
      const body = chat
        ? { messages: [{ role: 'user', content: text }], max_tokens: 5, temperature: 0 }
        : { prompt: text, max_tokens: 5, temperature: 0 };
      return { path: chat ? '/v1/chat/completions' : '/v1/completions', body, stream };
    });
    const want = await Promise.all(
      reqs.map(async (q) => textOf((await post(`${ref.address}${q.path}`, q.body)).text, false)),
    );
    const got = await Promise.all(reqs.map((q) => post(`${proxy.url}${q.path}`, { ...q.body, stream: q.stream })));
    expect(got.map((g) => (g.status === 200 ? 200 : g.text))).toEqual(got.map(() => 200));
    for (const [i, g] of got.entries()) expect(textOf(g.text, reqs[i].stream)).toBe(want[i]);
    await until(() => prefill.freeBlocks === 48 && decode.freeBlocks === 48);
    expect([prefill.healthInfo().num_requests_waiting, decode.healthInfo().num_requests_waiting]).toEqual([0, 0]);
  });
});

describe('queue limits and answers', () => {
  it('a request bigger than the whole cache is a 400 kv_request_too_large at once, through the proxy too', async () => {
    const { prefill, proxy } = await serveTrio(closers, { prefill: { blocks: 8 }, decode: { blocks: 8 } });
    const body = { prompt: 'z'.repeat(16 * 9), max_tokens: 2 };
    for (const url of [`${prefill.address}/v1/completions`, `${proxy.url}/v1/completions`]) {
      const r = await post(url, body);
      expect(r.status).toBe(400);
      expect(JSON.parse(r.text).error.code ?? JSON.parse(r.text).error.type).toBe('kv_request_too_large');
    }
    expect((await health(prefill)).num_requests_waiting).toBe(0);
  });

  it('a wait past kvWaitMs is a 503 kv_cache_full with Retry-After, after both prefills were tried; then a 200', async () => {
    const { prefill, proxy } = await serveTrio(closers, {
      prefill: { blocks: 16, kvWaitMs: 300 },
      decode: { blocks: 64 },
    });
    const other = await startWorker({ transport: 'http', blocks: 16, kvWaitMs: 300 });
    closers.push(() => other.close());
    proxy.pools.prefill.add(other.address);
    const big = 'fill the cache '.repeat(14); // 13+ of the 16 blocks
    const holds = [await hold(prefill, big), await hold(other, big)];
    expect(holds.map((h) => h.status)).toEqual([200, 200]);
    expect(prefill.freeBlocks).toBeLessThan(8);
    const r = await post(`${proxy.url}/v1/completions`, { prompt: 'q'.repeat(16 * 8), max_tokens: 3 });
    expect(r.status).toBe(503);
    expect(r.headers.get('retry-after')).toMatch(/^\d+$/);
    const err = JSON.parse(r.text).error;
    expect(err.code).toBe('kv_cache_full');
    expect(proxy.stats.retries).toBe(1);
    // Straight at the worker: the same 503 and header.
    const direct = await post(`${prefill.address}/v1/completions`, {
      prompt: 'q'.repeat(16 * 8),
      max_tokens: 1,
      kv_transfer_params: prefillRequestParams(),
    });
    expect(direct.status).toBe(503);
    expect(direct.headers.get('retry-after')).toBe('1');
    // One prefill frees its blocks: the next request is served there.
    await release(other, holds[1].id);
    const ok = await post(`${proxy.url}/v1/completions`, { prompt: 'q'.repeat(16 * 8), max_tokens: 3 });
    expect(ok.status).toBe(200);
    await release(prefill, holds[0].id);
    await until(() => prefill.freeBlocks === 16 && other.freeBlocks === 16);
  });

  it('a client that goes away while queued leaves the queue; the next waiter gets the blocks', async () => {
    const w = await startWorker({ transport: 'http', blocks: 16 });
    closers.push(() => w.close());
    const h = await hold(w, 'fill the cache '.repeat(14));
    expect(h.status).toBe(200);
    const ac = new AbortController();
    const gone = hold(w, 'q'.repeat(16 * 8), ac.signal).catch((e) => e as Error);
    await until(async () => (await health(w)).num_requests_waiting === 1);
    const next = hold(w, 'n'.repeat(16 * 8));
    await until(async () => (await health(w)).num_requests_waiting === 2);
    ac.abort();
    expect(await gone).toBeInstanceOf(Error);
    await until(async () => (await health(w)).num_requests_waiting === 1);
    await release(w, h.id);
    const n = await next;
    expect(n.status).toBe(200);
    expect((await health(w)).num_requests_waiting).toBe(0);
    await release(w, n.id);
    await until(() => w.freeBlocks === 16);
  });

  it('waiters are served strictly in order: a small one never passes a big one at the head', async () => {
    const w = await startWorker({ transport: 'http', blocks: 16 });
    closers.push(() => w.close());
    const a = await hold(w, 'a'.repeat(16 * 4)); // ~5 blocks
    const b = await hold(w, 'b'.repeat(16 * 8)); // ~9 blocks
    expect([a.status, b.status]).toEqual([200, 200]);
    const order: string[] = [];
    const big = hold(w, 'B'.repeat(16 * 12)).then(noted(order, 'big'));
    await until(async () => (await health(w)).num_requests_waiting === 1);
    const small = hold(w, 's'.repeat(16 * 2)).then(noted(order, 'small'));
    await until(async () => (await health(w)).num_requests_waiting === 2);
    // Enough for the small one, not for the big one at the head: nobody is served.
    await release(w, a.id);
    await sleep(300);
    expect(order).toEqual([]);
    expect((await health(w)).num_requests_waiting).toBe(2);
    await release(w, b.id);
    const [rb, rs] = await Promise.all([big, small]);
    expect([rb.status, rs.status]).toEqual([200, 200]);
    await Promise.all([release(w, rb.id), release(w, rs.id)]);
    await until(() => w.freeBlocks === 16);
  });
});

describe('BlockPool', () => {
  it('serves in order, refuses past the queue length and the deadline, and lets an aborted waiter go', async () => {
    const p = new BlockPool(10, { kvWaitMs: 200, kvQueueMax: 2 });
    const first = p.take(8)!;
    const got: string[] = [];
    const ac = new AbortController();
    const x = p.acquire(5, ac.signal).catch((e) => e);
    const y = p.acquire(2).then(noted(got, 'y'));
    expect(p.waiting).toBe(2);
    await expect(p.acquire(1)).rejects.toMatchObject({ status: 503, code: 'kv_queue_full' });
    // y fits now but x is first.
    expect(p.take(1)).toBeUndefined();
    ac.abort();
    expect(await x).toMatchObject({ status: 499 });
    expect((await y).length).toBe(2);
    expect(p.waiting).toBe(0);
    await expect(p.acquire(11)).rejects.toMatchObject({ status: 400, code: 'kv_request_too_large' });
    await expect(p.acquire(5)).rejects.toMatchObject({ status: 503, code: 'kv_cache_full' });
    expect(retryAfterHeader('kv_cache_full')).toEqual({ 'retry-after': '1' });
    p.give(first);
    expect(got).toEqual(['y']);
    expect(p.available).toBe(8);
  });
});
