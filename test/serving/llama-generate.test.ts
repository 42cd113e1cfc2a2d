// POST /inference/v1/generate with a real model (a generated GGUF through
// node-llama-cpp): token ids in, P/D through the proxy, and the ids out
// spell exactly what node-llama-cpp generates alone for the same prompt.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { OneProcess } from '../../demo/llama-reference';
import { startWorker } from '../../lib/serving';
import { serveTrio } from '../helpers';

const CTX = { contextSize: 2048, threads: 1 };
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-generate-'));
let ref: OneProcess;
let gguf: string;
const closers: Array<() => unknown> = [];

beforeAll(async () => {
  gguf = modelPath('tiny', dir);
  ref = await OneProcess.load(gguf, CTX);
}, 60_000);
afterAll(async () => {
  for (const c of closers.reverse()) await c();
  await ref?.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

const GEN = '/inference/v1/generate';

async function post(url: string, body: Record<string, unknown>) {
  const r = await fetch(`${url}${GEN}`, { method: 'POST', body: JSON.stringify(body) });
  if (!(r.headers.get('content-type') ?? '').includes('text/event-stream'))
    return { status: r.status, json: await r.json(), ids: [] as number[] };
  const ids: number[] = [];
  let last: Record<string, unknown> = {};
  for (const line of (await r.text()).split('\n\n'))
    if (line.startsWith('data: {')) {
      last = JSON.parse(line.slice(6));
      ids.push(...((last.choices as Array<{ token_ids: number[] }>)[0]?.token_ids ?? []));
    }
  return { status: r.status, json: last, ids };
}

describe('generate with a GGUF worker pair behind the proxy', () => {
  it('token ids in and out, equal to node-llama-cpp alone; a leading BOS is the model’s own; ids outside the vocabulary refused', async () => {
    const w = { model: gguf, ...CTX, parallel: 1, blockBytes: 4096, blocks: 1024 };
    const { proxy, prefill, decode } = await serveTrio(closers, { prefill: w, decode: w });
    const vocab = (decode.model.tokenizer?.vocabSize ?? 0) as number;
    expect(vocab).toBeGreaterThan(256);
    for (const text of ['the cat sat on a warm mat', 'rain fell over quiet hills and rivers while']) {
      const want = (await ref.generate({ chat: false, text, maxTokens: 8 })).text;
      // As LlamaCompletion tokenizes a prompt after its BOS.
      const ids = Array.from(ref.model.tokenize(text, false, 'trimLeadingSpace'));
      for (const stream of [false, true]) {
        const r = await post(proxy.url, { token_ids: ids, sampling_params: { max_tokens: 8, temperature: 0 }, stream });
        expect(r.status, JSON.stringify(r.json)).toBe(200);
        const out = stream ? r.ids : (r.json.choices[0].token_ids as number[]);
        expect(ref.model.detokenize(out as never)).toBe(want);
        // At most max_tokens ids, and usage counts those returned.
        expect(out.length).toBeLessThanOrEqual(8);
        if (!stream) expect(r.json.usage.completion_tokens).toBe(out.length);
        expect(r.json.nixl_node?.kv_moved).toBe(true);
      }
    }
    // The model puts its BOS first itself: one sent is not evaluated twice.
    const bos = decode.model.tokenizer?.bos;
    expect(bos).toBeDefined();
    const text = 'the cat sat on a warm mat';
    const ids = Array.from(ref.model.tokenize(text, false, 'trimLeadingSpace'));
    const withBos = await post(proxy.url, {
      token_ids: [bos, ...ids],
      sampling_params: { max_tokens: 8, temperature: 0 },
    });
    expect(withBos.status).toBe(200);
    expect(ref.model.detokenize(withBos.json.choices[0].token_ids)).toBe(
      (await ref.generate({ chat: false, text, maxTokens: 8 })).text,
    );
    expect(withBos.json.usage.prompt_tokens).toBe(ids.length + 1);
    expect(prefill.stats.prefills).toBe(5);
    expect(decode.stats.decodes).toBe(5);
    const outside = await post(proxy.url, { token_ids: [1, vocab], sampling_params: {} });
    expect(outside.status).toBe(400);
    expect(outside.json.error.message).toMatch(/outside the vocabulary/);
  }, 120_000);

  it('no max_tokens: as many tokens as the context leaves (its BOS counted), not 16 and not a 400', async () => {
    const w = await startWorker({
      model: gguf,
      contextSize: 64,
      threads: 1,
      parallel: 1,
      blocks: 64,
      blockBytes: 4096,
    });
    closers.push(() => w.close());
    const ids = Array.from(ref.model.tokenize('the cat sat on a warm mat', false, 'trimLeadingSpace'));
    const r = await post(w.address, { token_ids: ids, sampling_params: { temperature: 0 } });
    expect(r.status, JSON.stringify(r.json)).toBe(200);
    expect(r.json.usage.prompt_tokens).toBe(ids.length + 1);
    expect(r.json.usage.prompt_tokens + r.json.usage.completion_tokens).toBeLessThanOrEqual(64);
    expect(r.json.usage.completion_tokens).toBe(r.json.choices[0].token_ids.length);
    // max_tokens bounds the ids on a GGUF too, whatever its text encodes to again.
    for (const n of [1, 3])
      for (const stream of [false, true]) {
        const c = await post(w.address, {
          token_ids: ids,
          sampling_params: { max_tokens: n, temperature: 0 },
          stream,
          ...(stream ? { stream_options: { include_usage: true } } : {}),
        });
        expect(c.status, JSON.stringify(c.json)).toBe(200);
        const out = stream ? c.ids : (c.json.choices[0].token_ids as number[]);
        expect(out.length).toBeGreaterThan(0);
        expect(out.length).toBeLessThanOrEqual(n);
        expect(c.json.usage.completion_tokens).toBe(out.length);
      }
  }, 60_000);
});
