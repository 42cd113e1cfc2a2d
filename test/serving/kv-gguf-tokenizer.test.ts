// Precise routing with the workers' GGUF loaded in the proxy (vocabulary and
// chat template, no weights): its ids are the ids a worker's /tokenize answers
// for the same bodies, a proxy routes on them, and a file it cannot load fails
// the proxy's start with a code.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { ggufTokenizer } from '../../lib/serving/kv-index/gguf-tokenizer';
import { modelPath } from '../../lib/serving/models/test-models';
import { chat } from './kv-routing-helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-gguf-tok-'));
const BATCH = 32;
let prefills: Worker[] = [];
let decode: Worker | undefined;

beforeAll(async () => {
  const common = { model: modelPath('tiny'), contextSize: 1024, threads: 1, parallel: 1, batchSize: BATCH };
  prefills = await Promise.all(
    [0, 1].map((i) =>
      startWorker({
        ...common,
        role: 'prefill',
        kvEvents: { enable_kv_cache_events: true, endpoint: `ipc://${dir}/p${i}` },
      }),
    ),
  );
  decode = await startWorker({ ...common, role: 'decode' });
}, 120_000);

afterAll(async () => {
  await Promise.all([...prefills, ...(decode ? [decode] : [])].map((w) => w.close()));
  fs.rmSync(dir, { recursive: true, force: true });
});

async function workerIds(w: Worker, body: Record<string, unknown>): Promise<unknown> {
  const r = await fetch(`${w.address}/tokenize`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return r.ok ? ((await r.json()) as { tokens: number[] }).tokens : `HTTP ${r.status}`;
}

describe('the GGUF tokenizer', () => {
  it("gives the ids a worker's /tokenize gives, for texts, chats and ids", async () => {
    const t = await ggufTokenizer(modelPath('tiny'));
    try {
      const texts = [
        'What is 2 + 2?',
        ' leading space, and trailing ',
        '数据中心的缓存 — KV блоки, emoji 🚀🧠 and a combining é',
        'x'.repeat(700),
      ];
      for (const prompt of texts) {
        const mine = await t.tokens({ model: 'm', prompt });
        expect(mine, prompt).toEqual(await workerIds(prefills[0], { prompt }));
        expect(await t.tokens({ prompt: [prompt] }), prompt).toEqual(mine);
      }
      const messages = [
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: 'Привет! ¿Qué tal? 你好' },
        { role: 'assistant', content: 'Fine.' },
        { role: 'user', content: [{ type: 'text', text: 'And now?' }] },
      ];
      const chat = await t.tokens({ messages });
      expect(chat).toEqual(await workerIds(prefills[0], { messages }));
      expect((chat as number[]).length).toBeGreaterThan(20);
      // Ids as given are taken as they are; what cannot be a prompt gives none (the proxy routes by load).
      expect(await t.tokens({ prompt: [5, 6, 7] })).toEqual([5, 6, 7]);
      expect(await t.tokens({ prompt: [[8, 9]] })).toEqual([8, 9]);
      expect(await t.tokens({ prompt: 42 })).toBeUndefined();
      expect(await t.tokens({})).toBeUndefined();
      // A prompt longer in bytes than the trained context times the longest piece (the tiny model: 4096 x 6)
      // has more tokens than any worker holds: not tokenized (llama.cpp's tokenizer runs on the proxy's loop,
      // 0.65 s for these 100 KB here, 96 s for 1 MB), routed by load. Below that, the worker's ids.
      const huge = 'x'.repeat(100_000);
      expect(await t.tokens({ prompt: huge })).toBeUndefined();
      expect(await t.tokens({ messages: [{ role: 'user', content: [{ type: 'text', text: huge }] }] })).toBeUndefined();
      const long = 'y'.repeat(20_000);
      expect(await t.tokens({ prompt: long })).toEqual(await workerIds(prefills[0], { prompt: long }));
      const bad = [{ role: 'tool', content: 'x' }];
      expect(await t.tokens({ messages: bad })).toBeUndefined();
      expect(await workerIds(prefills[0], { messages: bad })).toBe('HTTP 400');
    } finally {
      await t.close();
    }
  });

  it('a proxy routes on it: a prompt that shares a prefix goes to the prefill holding it', async () => {
    const endpoints = Object.fromEntries(prefills.map((w) => [w.address, { pub: w.kvEvents!.info.endpoint }]));
    const proxy = await startProxy({
      prefill: prefills.map((w) => w.address),
      decode: [decode!.address],
      policy: 'precise',
      healthIntervalMs: 0,
      kvEvents: { endpoints, blockSize: BATCH, tokenizer: { gguf: modelPath('tiny') }, index: { speculativeTtlMs: 1 } },
    });
    try {
      // Chats: the proxy's own synthetic tokenizer renders them otherwise than the GGUF's template, so only
      // the model's vocabulary and template find the held blocks.
      const system = 'Ein gemeinsamer Anfang — 共通の前置き, shared by both chats. '.repeat(4);
      const ask = (question: string, extra: Record<string, unknown> = {}) => chat(proxy, system, question, extra);
      const first = await ask('One?');
      expect(first.prefix_match_tokens).toBe(0);
      // The prefill's events reach the proxy asynchronously: wait until they have (bounded), and past the
      // decision's own speculative entry (1 ms, counted in 100 ms ticks), so that only the events can match.
      for (let i = 0; i < 100 && proxy.kvRouting!.index.size === 0; i++) await new Promise((r) => setTimeout(r, 50));
      await new Promise((r) => setTimeout(r, 250));
      const second = await ask('Two?');
      expect(second.prefill).toBe(first.prefill);
      expect(second.prefix_match_tokens).toBeGreaterThanOrEqual(2 * BATCH);
      expect(second.prefix_match_tokens % BATCH).toBe(0);
      // A chat's prompt is its messages: a `prompt` field beside them (no schema forbids one, and the worker
      // ignores it) must not be what the proxy tokenizes, or the request routes on tokens no prefill computes.
      await new Promise((r) => setTimeout(r, 250));
      const decoy = await ask('Three?', { prompt: 'a decoy that shares nothing with the chat' });
      expect(decoy.prefill).toBe(first.prefill);
      expect(decoy.prefix_match_tokens).toBeGreaterThanOrEqual(2 * BATCH);
    } finally {
      await proxy.close();
    }
  }, 120_000);

  it('a worker refuses a prompt longer in bytes than its context holds tokens without tokenizing it', async () => {
    // llama.cpp's tokenizer runs on the worker's event loop: 1.2 s for these 100 KB, about 100 s for 1 MB.
    // Refused untokenized, the answer says bytes (a count of its tokens would have taken the tokenizer).
    const text = 'the quiet hills and rivers under rain. '.repeat(2600);
    for (const [route, body] of [
      ['completions', { prompt: text }],
      ['chat/completions', { messages: [{ role: 'user', content: [{ type: 'text', text }] }] }],
    ] as const) {
      const r = await fetch(`${prefills[0].address}/v1/${route}`, {
        method: 'POST',
        body: JSON.stringify({ ...body, max_tokens: 2 }),
      });
      expect(r.status, route).toBe(400);
      const e = ((await r.json()) as { error: { message: string } }).error.message;
      expect(e, route).toMatch(/a prompt of 101400 bytes has more tokens than this model's context holds/);
    }
    // A prompt under the bound is still tokenized and answered as before (its token count).
    const r = await fetch(`${prefills[0].address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: 'x'.repeat(2000), max_tokens: 2 }),
    });
    expect(r.status).toBe(400);
    expect(((await r.json()) as { error: { message: string } }).error.message).toMatch(/2001 in the prompt/);
  }, 60_000);

  it("a file it cannot load fails the proxy's start with a code", async () => {
    const notGguf = path.join(dir, 'not-a-model.gguf');
    fs.writeFileSync(notGguf, 'this is not a GGUF file');
    for (const gguf of [path.join(dir, 'missing.gguf'), notGguf])
      await expect(
        startProxy({
          prefill: [prefills[0].address],
          decode: [decode!.address],
          policy: 'precise',
          port: 0,
          healthIntervalMs: 0,
          kvEvents: { tokenizer: { gguf } },
        }),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
  });
});
