// A GGUF prefill reuses the prompt an earlier request left in its context
// (lib/serving/models/llama/prefix.ts), in whole batches of the common
// prefix, and changes no number: a prompt that shares a prefix evaluates
// only the rest, its state (and so the KV a decode loads) is byte for byte a
// fresh prefill's, a prompt that differs reuses nothing, and every answer
// through proxy -> prefill -> decode, greedy, sampled with a seed, chat,
// streamed, non-ASCII, equals node-llama-cpp generating alone.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Ask, type Generation, OneProcess, askBody } from '../../demo/llama-reference';
import { LlamaModel } from '../../lib/serving/models/llama';
import { reusableTokens } from '../../lib/serving/models/llama/prefix';
import { modelPath } from '../../lib/serving/models/test-models';
import type { GenerationRequest, PrefilledKv } from '../../lib/serving/models/types';
import { serveTrio } from '../helpers';

/** Batches of 64 (not the default 512): prompts of a few hundred tokens share whole ones, and a prefix cut mid-batch changes their states. */
const BATCH = 64;
const CTX = { contextSize: 1024, threads: 1, batchSize: BATCH };
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-prefix-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

const BASE = 'You are a careful assistant. Answer in one short sentence, and be exact. '.repeat(3);
const UTF8_BASE = '你是一个认真的助手。请用一句话回答，务必准确。Réponds brièvement. Привет! '.repeat(2);

function req(o: Partial<GenerationRequest>): GenerationRequest {
  return { chat: false, prompt: '', messages: [], maxTokens: 4, temperature: 0, stop: [], ...o };
}

/** The envelope a prefill writes into its blocks (the bytes a decode pulls), for one fixed request. */
function envelope(kv: PrefilledKv, blockBytes: number): Buffer {
  const all = Buffer.alloc(kv.blocks * blockBytes);
  kv.writeTo((i) => all.subarray(i * blockBytes, (i + 1) * blockBytes), {
    engineId: 'e',
    requestId: 'r',
    blockIds: [],
  });
  return all;
}

describe('reusableTokens', () => {
  const t = (...a: number[]) => a as Nlc.Token[];
  it('takes the common prefix in whole batches, never more than is exact', () => {
    expect(reusableTokens(t(1, 2, 3, 4, 5, 6), 6, t(1, 2, 3, 4, 9), 2)).toBe(4);
    expect(reusableTokens(t(1, 2, 3, 4, 5, 6), 6, t(1, 2, 3, 9), 2)).toBe(2);
    expect(reusableTokens(t(1, 2, 3, 4, 5, 6), 2, t(1, 2, 3, 4, 5), 2)).toBe(2);
    expect(reusableTokens(t(1, 2, 3, 4), 4, t(7, 2, 3, 4), 1)).toBe(0);
    expect(reusableTokens(t(), 0, t(1, 2), 1)).toBe(0);
  });
});

describe.each(['tiny', 'tiny-utf8'])('%s: a prefill reuses whole batches of a cached prefix', (name) => {
  const blockBytes = 4096;
  let cached: LlamaModel;
  let fresh: LlamaModel;
  const base = name === 'tiny' ? BASE : UTF8_BASE;

  beforeAll(async () => {
    const o = { modelPath: modelPath(name, dir), ...CTX, parallel: 1, blockBytes, poolBytes: 512 * blockBytes };
    cached = await LlamaModel.load(o);
    fresh = await LlamaModel.load({ ...o, prefixCache: false });
  }, 120_000);
  afterAll(async () => {
    await cached?.close();
    await fresh?.close();
  });

  const signal = new AbortController().signal;
  const cases: Array<[string, GenerationRequest, GenerationRequest]> = [
    ['completion', req({ prompt: `${base}First: what is 2+2?` }), req({ prompt: `${base}Second: name a colour.` })],
    [
      'chat',
      req({
        chat: true,
        messages: [
          { role: 'system', content: base },
          { role: 'user', content: 'Hi! 你好' },
        ],
      }),
      req({
        chat: true,
        messages: [
          { role: 'system', content: base },
          { role: 'user', content: 'Bye, до свидания' },
        ],
      }),
    ],
    [
      'sampled with a seed',
      req({ prompt: `${base}一`, temperature: 0.8, seed: 7 }),
      req({ prompt: `${base}二, and more`, temperature: 0.8, seed: 7 }),
    ],
  ];

  it.each(cases)(
    '%s: the second prompt evaluates only what follows the reused batches; its KV equals a fresh prefill’s',
    async (_, first, second) => {
      await cached.prefill(first, signal);
      const kv = await cached.prefill(second, signal);
      const ref = await fresh.prefill(second, signal);
      expect(kv.promptTokens).toBe(ref.promptTokens);
      expect(envelope(kv, blockBytes).equals(envelope(ref, blockBytes))).toBe(true);
      const reused = Number(kv.info?.prefix_reused_tokens);
      expect(reused).toBeGreaterThanOrEqual(2 * BATCH);
      expect(reused % BATCH).toBe(0);
      expect(kv.info?.tokens_evaluated).toBe(kv.promptTokens - reused);
      expect(ref.info).toEqual({ prefix_reused_tokens: 0, tokens_evaluated: ref.promptTokens });
    },
    60_000,
  );

  it('a prompt that differs from the first token reuses nothing; the same prompt again reuses all but its last batch', async () => {
    const p = `${base}Third: and now?`;
    await cached.prefill(req({ prompt: p }), signal);
    const other = await cached.prefill(req({ prompt: `Something else entirely. ${base}` }), signal);
    expect(other.info).toEqual({ prefix_reused_tokens: 0, tokens_evaluated: other.promptTokens });
    await cached.prefill(req({ prompt: p }), signal);
    const again = await cached.prefill(req({ prompt: p }), signal);
    // The class evaluates the last token to sample: the batch that holds it is evaluated again.
    expect(again.info?.prefix_reused_tokens).toBe(Math.floor((again.promptTokens - 1) / BATCH) * BATCH);
    const ref = await fresh.prefill(req({ prompt: p }), signal);
    expect(envelope(again, blockBytes).equals(envelope(ref, blockBytes))).toBe(true);
  }, 60_000);

  it('an aggregated generation reuses too, and answers as one without the cache', async () => {
    const sink = () => {};
    await cached.generate(req({ prompt: `${base}Fourth?`, maxTokens: 6 }), sink, signal);
    let a = '';
    let b = '';
    const g = await cached.generate(req({ prompt: `${base}Fifth?`, maxTokens: 6 }), (t) => (a += t), signal);
    const r = await fresh.generate(req({ prompt: `${base}Fifth?`, maxTokens: 6 }), (t) => (b += t), signal);
    expect(Number(g.info.prefix_reused_tokens)).toBeGreaterThan(0);
    expect(a).toBe(b);
    expect(g.completionTokens).toBe(r.completionTokens);
  }, 60_000);
});

describe('through proxy -> prefill -> decode (tiny-utf8): answers equal node-llama-cpp alone', () => {
  let ref: OneProcess;
  const gguf = modelPath('tiny-utf8', dir);
  const asks: Ask[] = [];
  for (let i = 0; i < 8; i++) {
    const chat = i % 2 === 1;
    const tail = ['一个问题', 'a question', 'вопрос', 'café ☕', '🙂 ok', 'なぜ', 'x', 'ß'][i];
    asks.push({
      chat,
      text: chat ? tail : `${UTF8_BASE}${tail}`,
      history: chat ? [{ role: 'system', content: UTF8_BASE }] : undefined,
      maxTokens: 3 + (i % 4) * 3,
      ...(i % 3 === 2 ? { temperature: 0.8, seed: 100 + i } : {}),
    });
  }
  const want: Generation[] = [];
  const closers: Array<() => unknown> = [];

  beforeAll(async () => {
    ref = await OneProcess.load(gguf, CTX);
    for (const a of asks) want.push(await ref.generate(a));
  }, 300_000);
  afterAll(async () => {
    for (const f of closers.reverse()) await f();
    await ref?.close();
  });

  it('each answer (twice over, streamed the second time) is the one-process answer; prefills reused', async () => {
    const w = { model: gguf, ...CTX, parallel: 2, blockBytes: 4096, blocks: 512 };
    const { proxy, prefill } = await serveTrio(closers, { prefill: w, decode: w });
    for (const stream of [false, true])
      for (const [i, a] of asks.entries()) {
        const res = await fetch(`${proxy.url}/v1/${a.chat ? 'chat/completions' : 'completions'}`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify(askBody(a, stream)),
        });
        const body = await res.text();
        expect(res.status, body).toBe(200);
        let text = '';
        let info: Record<string, unknown> | undefined;
        for (const j of stream
          ? body
              .split('\n')
              .filter((l) => l.startsWith('data: {'))
              .map((l) => JSON.parse(l.slice(6)))
          : [JSON.parse(body)]) {
          const c = j.choices[0];
          text += (a.chat ? (stream ? c.delta?.content : c.message?.content) : c.text) ?? '';
          info = j.nixl_node ?? info;
        }
        expect(text, `${i} ${stream}`).toBe(want[i].text);
        expect(info?.kv_tokens_loaded, `${i}`).toBe(want[i].promptTokens);
        expect(info?.kv_continued, `${i}`).toBe(true);
      }
    expect(prefill.stats.prefixReusedTokens).toBeGreaterThan(8 * BATCH);
    expect(prefill.stats.prefillEvaluatedTokens + prefill.stats.prefixReusedTokens).toBe(
      2 * want.reduce((s, g) => s + g.promptTokens, 0),
    );
  }, 300_000);
});
