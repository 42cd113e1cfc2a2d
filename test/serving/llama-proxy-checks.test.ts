// A GGUF model (the generated tiny one) through the proxy, against the same
// request to one worker: the context check, the prompt's token count, and a
// decode that refuses bad KV staying in the pool.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { startProxy, startWorker, type Worker } from '../../lib/serving';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-proxy-'));
const opts = { contextSize: 256, threads: 1, parallel: 1, blockBytes: 4096, blocks: 1024 };
const closers: Array<() => unknown> = [];
let gguf: string;
beforeAll(() => {
  gguf = modelPath('tiny', dir);
});
afterAll(async () => {
  for (const c of closers.splice(0).reverse()) await c();
  fs.rmSync(dir, { recursive: true, force: true });
});

async function worker(o: Parameters<typeof startWorker>[0] = {}): Promise<Worker> {
  const w = await startWorker({ ...opts, model: gguf, ...o });
  closers.push(() => w.close());
  return w;
}

async function post(url: string, p: string, body: Record<string, unknown>) {
  const r = await fetch(`${url}${p}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: r.status, json: (await r.json()) as Record<string, unknown> };
}

const usage = (j: Record<string, unknown>) => (j.usage as { prompt_tokens: number }).prompt_tokens;
const errorOf = (j: Record<string, unknown>) => j.error as { message: string; type?: string; code?: string };

describe('tiny GGUF: one worker and prefill + decode through the proxy agree', () => {
  let single: Worker;
  let p: Worker;
  let d: Worker;
  let proxyUrl: string;
  beforeAll(async () => {
    single = await worker();
    p = await worker();
    d = await worker();
    const proxy = await startProxy({ prefill: [p.address], decode: [d.address], healthIntervalMs: 0 });
    closers.push(() => proxy.close());
    proxyUrl = proxy.url;
  }, 60_000);

  it('a prompt and max_tokens past the context: 400 from one worker and through the proxy, greedy or not', async () => {
    // 196 letters: a token each in the tiny model's byte vocabulary (a space
    // is 3: SentencePiece's U+2581), and BOS: 197 tokens, as in the report.
    const prompt = 'quiethills'.repeat(19).concat('andrai');
    for (const temperature of [0, 0.8]) {
      const body = { prompt, max_tokens: 100, temperature };
      const one = await post(single.address, '/v1/completions', body);
      expect(one.status, JSON.stringify(one.json)).toBe(400);
      expect(errorOf(one.json).message).toMatch(/context holds 256 tokens/);
      const via = await post(proxyUrl, '/v1/completions', body);
      expect(via.status, JSON.stringify(via.json)).toBe(400);
      expect(errorOf(via.json).message).toMatch(/context holds 256 tokens/);
    }
    // The decode refused before its pull, and the prefill's hold went back at once.
    expect(d.stats.kvPullMs).toBe(0);
    expect(d.stats.decodes).toBe(0);
    await expect.poll(() => p.freeBlocks, { timeout: 1000 }).toBe(opts.blocks);
    for (const temperature of [0, 0.8]) {
      const body = { messages: [{ role: 'user', content: 'a'.repeat(200) }], max_tokens: 100, temperature };
      expect((await post(single.address, '/v1/chat/completions', body)).status).toBe(400);
      expect((await post(proxyUrl, '/v1/chat/completions', body)).status).toBe(400);
    }
    // What fits is served.
    const fits = await post(proxyUrl, '/v1/completions', { prompt, max_tokens: 8, temperature: 0 });
    expect(fits.status, JSON.stringify(fits.json)).toBe(200);
  }, 60_000);

  it('usage.prompt_tokens: the same count from one worker and through prefill and decode', async () => {
    for (const prompt of ['Hello there', ' leading space and trailing  ', 'the quiet hills '.repeat(4)]) {
      const body = { prompt, max_tokens: 4, temperature: 0 };
      const one = await post(single.address, '/v1/completions', body);
      const via = await post(proxyUrl, '/v1/completions', body);
      expect(one.status).toBe(200);
      expect(via.status).toBe(200);
      expect(usage(via.json), JSON.stringify(prompt)).toBe(usage(one.json));
    }
    for (const content of ['hi', 'a longer question about rivers']) {
      const body = { messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 };
      const one = await post(single.address, '/v1/chat/completions', body);
      const via = await post(proxyUrl, '/v1/chat/completions', body);
      expect(usage(via.json), content).toBe(usage(one.json));
    }
  }, 60_000);
});

it('a decode that refuses a bad state stays in the pool: the honest prefill answers next', async () => {
  const bad = await worker({ testHooks: { tamperKv: 'corrupt' } });
  const good = await worker();
  const decode = await worker();
  const proxy = await startProxy({
    prefill: [bad.address, good.address],
    decode: [decode.address],
    healthIntervalMs: 0,
  });
  closers.push(() => proxy.close());
  for (let i = 0; i < 4; i++) {
    const r = await post(proxy.url, '/v1/completions', { prompt: `round ${i} of rain`, max_tokens: 4, temperature: 0 });
    // Each request meets the tampering prefill or the honest one first; a
    // refusal is retried once on a fresh prefill, so every one is served.
    expect(r.status, JSON.stringify(r.json)).toBe(200);
    expect(proxy.pools.decode.workers[0].healthy).toBe(true);
  }
  expect(decode.stats.rejectedKv).toBeGreaterThan(0);
}, 60_000);
