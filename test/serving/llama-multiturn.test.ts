// Bidirectional KV on GGUF workers (docs/multiturn.md): through the proxy,
// with a conversation_id, turn 2 and 3 of a chat read the previous turn's KV
// from the decode that answered it, and answer exactly as node-llama-cpp
// alone given the same messages (no system prompt added), as the same turns
// recomputed do. What does not prove to be the prompt's (an edited history)
// is recomputed.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { OneProcess } from '../../demo/llama-reference';
import type { Worker } from '../../lib/serving';
import { modelPath } from '../../lib/serving/models/test-models';
import { serveTrio } from '../helpers';

const CTX = { contextSize: 1024, threads: 1, batchSize: 16 };
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-multiturn-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

// biome-ignore lint/suspicious/noExplicitAny: answers are JSON read field by field
type Json = Record<string, any>;
type Message = { role: string; content: string };

const CONVERSATIONS: Record<string, string[]> = {
  tiny: [
    'Hello! Tell me a short story about a dragon and a knight who become friends.',
    'What was the name of the dragon? Was it « Drogo » or 龍?',
    'And the knight, where did he live?',
  ],
  small: ['Good morning. Can you explain how bread is made?', 'Why does the dough rise?', 'How long should it bake?'],
  'tiny-utf8': [
    'Привет! Расскажи мне короткую историю о драконе. 你好吗？',
    'Quel temps fait-il aujourd’hui ? 今天天气怎么样？',
    'Спасибо! ありがとう 🙂',
  ],
};

async function chat(
  url: string,
  messages: Message[],
  maxTokens: number,
  conversation?: string,
): Promise<{ text: string; info: Json; promptTokens: number }> {
  const r = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      messages,
      max_tokens: maxTokens,
      temperature: 0,
      ...(conversation ? { conversation_id: conversation } : {}),
    }),
  });
  const json = (await r.json()) as Json;
  expect(r.status, JSON.stringify(json)).toBe(200);
  return {
    text: json.choices[0].message.content as string,
    info: json.nixl_node as Json,
    promptTokens: json.usage.prompt_tokens,
  };
}

// tiny-utf8 writes pieces of multi-byte characters: its answers come back as
// other text (U+FFFD) than the tokens it generated, so only what precedes
// them (the history) is reused.
describe('a held turn damaged on the decode (tiny)', () => {
  const closers: Array<() => unknown> = [];
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
  });

  it('is refused by the next prefill, which recomputes: the same answer as node-llama-cpp alone', async () => {
    const gguf = modelPath('tiny', dir);
    const ref = await OneProcess.load(gguf, CTX);
    closers.push(() => ref.close());
    const worker = { model: gguf, ...CTX, bidirectionalKv: true, kvRecomputeThreshold: 16, kvSecret: 's3cret' };
    const { proxy, prefill } = await serveTrio(closers, {
      prefill: { ...worker, prefixCache: false },
      decode: { ...worker, testHooks: { tamperKv: 'corrupt' } },
    });
    const first = CONVERSATIONS.tiny[0];
    const a = await chat(proxy.url, [{ role: 'user', content: first }], 24, 'damaged');
    const messages = [
      { role: 'user', content: first },
      { role: 'assistant', content: a.text },
      { role: 'user', content: CONVERSATIONS.tiny[1] },
    ];
    const b = await chat(proxy.url, messages, 20, 'damaged');
    expect(b.info.kv_reused_tokens).toBe(0);
    expect(prefill.turns!.stats).toMatchObject({ turnsReused: 0, turnsRecomputed: 1 });
    const last = messages.at(-1)!;
    expect(b.text).toBe(
      (await ref.generate({ chat: true, text: last.content, history: messages.slice(0, -1), maxTokens: 20 })).text,
    );
  }, 120_000);
});

describe.each(['tiny', 'tiny-utf8', 'small'])('%s: turns of a chat through the proxy', (name) => {
  let ref: OneProcess;
  let trio: { prefill: Worker; decode: Worker; proxy: { url: string } };
  const closers: Array<() => unknown> = [];
  beforeAll(async () => {
    const gguf = modelPath(name, dir);
    ref = await OneProcess.load(gguf, CTX);
    const worker = { model: gguf, ...CTX, bidirectionalKv: true, kvRecomputeThreshold: 16, kvSecret: 's3cret' };
    // Without its prefix cache the prefill evaluates what it does not read (the cache would cover turn 1's prompt).
    trio = await serveTrio(closers, { prefill: { ...worker, prefixCache: false }, decode: worker });
  }, 120_000);
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
    await ref?.close();
  });

  /** What node-llama-cpp alone answers to these messages (the last one the user's). */
  async function reference(messages: Message[], maxTokens: number): Promise<string> {
    const last = messages.at(-1)!;
    return (await ref.generate({ chat: true, text: last.content, history: messages.slice(0, -1), maxTokens })).text;
  }

  it('turns 2 and 3 read the previous turn and answer as node-llama-cpp alone, as recomputed', async () => {
    const { proxy, prefill } = trio;
    const messages: Message[] = [];
    const conv = `c-${name}`;
    let previousPrompt = 0;
    for (const [i, user] of CONVERSATIONS[name].entries()) {
      messages.push({ role: 'user', content: user });
      const maxTokens = 24 + 4 * i;
      const a = await chat(proxy.url, messages, maxTokens, conv);
      expect(a.text).toBe(await reference(messages, maxTokens));
      if (i > 0) {
        expect(a.info.kv_reuse_skipped).toBeUndefined();
        expect(a.info.kv_reused_tokens).toBeGreaterThan(0);
        expect(a.info.kv_reused_tokens % CTX.batchSize).toBe(0);
        // Past the previous prompt's whole batches: the answer the decode evaluated one token at a time, too.
        if (name !== 'tiny-utf8')
          expect(a.info.kv_reused_tokens).toBeGreaterThan(previousPrompt - (previousPrompt % CTX.batchSize));
        // The same turn recomputed (no conversation) answers the same.
        const b = await chat(proxy.url, messages, maxTokens);
        expect(b.text).toBe(a.text);
      } else expect(a.info.kv_reused_tokens ?? 0).toBe(0);
      messages.push({ role: 'assistant', content: a.text });
      previousPrompt = a.promptTokens;
    }
    expect(prefill.turns!.stats.turnsReused).toBe(2);
  }, 120_000);

  it("a completion's turn 2 (its prompt, the answer, more) reads turn 1 and answers as node-llama-cpp alone", async () => {
    const { proxy } = trio;
    const complete = async (prompt: string, maxTokens: number, conversation?: string) => {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt, max_tokens: maxTokens, temperature: 0, conversation_id: conversation }),
      });
      const json = (await r.json()) as Json;
      expect(r.status, JSON.stringify(json)).toBe(200);
      return { text: json.choices[0].text as string, info: json.nixl_node as Json };
    };
    const p1 = `user: ${CONVERSATIONS[name][0]}\nassistant:`;
    const t1 = await complete(p1, 24, `completion-${name}`);
    const p2 = `${p1}${t1.text}\nuser: ${CONVERSATIONS[name][1]}\nassistant:`;
    const t2 = await complete(p2, 16, `completion-${name}`);
    expect(t2.info.kv_reused_tokens).toBeGreaterThan(0);
    expect(t2.text).toBe((await ref.generate({ chat: false, text: p2, maxTokens: 16 })).text);
    expect((await complete(p2, 16)).text).toBe(t2.text);
  }, 120_000);

  it('an edited history is recomputed, never read, and answers as node-llama-cpp alone', async () => {
    const { proxy, decode, prefill } = trio;
    const conv = `edited-${name}`;
    const recomputed = prefill.turns!.stats.turnsRecomputed;
    const first = CONVERSATIONS[name][0];
    const a = await chat(proxy.url, [{ role: 'user', content: first }], 24, conv);
    const held = decode.turns!.held;
    // The client sends back another history than the decode answered.
    const messages = [
      { role: 'user', content: `X${first.slice(1)}` },
      { role: 'assistant', content: a.text },
      { role: 'user', content: 'ok' },
    ];
    const b = await chat(proxy.url, messages, 20, conv);
    expect(b.info.kv_reused_tokens).toBe(0);
    expect(prefill.turns!.stats.turnsRecomputed).toBe(recomputed + 1);
    expect(b.text).toBe(await reference(messages, 20));
    // Turn 1's hold is freed (the proxy's own entry, not read), turn 2's is held.
    await expect.poll(() => decode.turns!.held).toBe(held);
  }, 120_000);
});

describe('the generate endpoint (tiny): token ids of the history', () => {
  const closers: Array<() => unknown> = [];
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
  });

  it("turn 2's ids (turn 1's, its answer's, more) read turn 1 and give the ids recomputing gives", async () => {
    const gguf = modelPath('tiny', dir);
    const worker = { model: gguf, ...CTX, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const { proxy, decode } = await serveTrio(closers, { prefill: { ...worker, prefixCache: false }, decode: worker });
    const tok = decode.model.tokenizer!;
    const generate = async (ids: number[], maxTokens: number, conversation?: string) => {
      const r = await fetch(`${proxy.url}/inference/v1/generate`, {
        method: 'POST',
        body: JSON.stringify({
          token_ids: ids,
          sampling_params: { max_tokens: maxTokens, temperature: 0 },
          ...(conversation ? { conversation_id: conversation } : {}),
        }),
      });
      const json = (await r.json()) as Json;
      expect(r.status, JSON.stringify(json)).toBe(200);
      return { ids: json.choices[0].token_ids as number[], info: json.nixl_node as Json };
    };
    const ids1 = tok.encode(`user: ${CONVERSATIONS.tiny[0]}\nassistant:`);
    const t1 = await generate(ids1, 24, 'gen');
    const ids2 = [...ids1, ...t1.ids, ...tok.encode(`\nuser: ${CONVERSATIONS.tiny[1]}\nassistant:`)];
    const t2 = await generate(ids2, 12, 'gen');
    expect(t2.info.kv_reused_tokens).toBeGreaterThan(ids1.length - (ids1.length % CTX.batchSize));
    expect((await generate(ids2, 12)).ids).toEqual(t2.ids);
  }, 120_000);
});

describe('over ZeroMQ, streamed (tiny)', () => {
  const closers: Array<() => unknown> = [];
  let ref: OneProcess;
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
    await ref?.close();
  });

  it("turn 2 streamed through a ZeroMQ proxy reads turn 1 and streams node-llama-cpp's answer", async () => {
    const gguf = modelPath('tiny', dir);
    ref = await OneProcess.load(gguf, CTX);
    const worker = { model: gguf, ...CTX, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const { proxy } = await serveTrio(closers, {
      transport: 'zmq',
      prefill: { ...worker, prefixCache: false },
      decode: worker,
    });
    const streamChat = async (messages: Message[], maxTokens: number) => {
      const r = await fetch(`${proxy.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ messages, max_tokens: maxTokens, temperature: 0, stream: true, conversation_id: 'z' }),
      });
      expect(r.status).toBe(200);
      const chunks = (await r.text())
        .split('\n\n')
        .filter((l) => l.startsWith('data: {'))
        .map((l) => JSON.parse(l.slice(6)) as Json);
      return {
        text: chunks.map((c) => c.choices?.[0]?.delta?.content ?? '').join(''),
        info: chunks.findLast((c) => c.nixl_node)?.nixl_node as Json,
      };
    };
    const messages: Message[] = [];
    for (const [i, user] of CONVERSATIONS.tiny.slice(0, 2).entries()) {
      messages.push({ role: 'user', content: user });
      const a = await streamChat(messages, 20);
      const last = messages.at(-1)!;
      const want = await ref.generate({
        chat: true,
        text: last.content,
        history: messages.slice(0, -1),
        maxTokens: 20,
      });
      expect(a.text).toBe(want.text);
      if (i === 0) expect(a.info?.kv_reused_tokens ?? 0).toBe(0);
      else expect(a.info.kv_reused_tokens).toBeGreaterThan(0);
      messages.push({ role: 'assistant', content: a.text });
    }
  }, 120_000);
});
