// GGUF conversations at once through the proxy (docs/multiturn.md): two
// conversations interleaved on workers of two contexts each (the prefill's
// own prefix cache on, as by default), and one conversation_id used by two
// clients at once with other histories. Every answer is node-llama-cpp's
// alone for its own messages, whatever each turn read.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { OneProcess } from '../../demo/llama-reference';
import { modelPath } from '../../lib/serving/models/test-models';
import { serveTrio } from '../helpers';

const CTX = { contextSize: 1024, threads: 1, batchSize: 16 };
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-turn-concurrent-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

// biome-ignore lint/suspicious/noExplicitAny: answers are JSON read field by field
type Json = Record<string, any>;
type Message = { role: string; content: string };

async function postChat(proxyUrl: string, messages: Message[], maxTokens: number, conversation: string) {
  const r = await fetch(`${proxyUrl}/v1/chat/completions`, {
    method: 'POST',
    body: JSON.stringify({ messages, max_tokens: maxTokens, temperature: 0, conversation_id: conversation }),
  });
  return { status: r.status, json: (await r.json()) as Json };
}

/** node-llama-cpp alone, in one process, on the same messages. */
const reference = async (ref: OneProcess, messages: Message[], maxTokens: number) =>
  (await ref.generate({ chat: true, text: messages.at(-1)!.content, history: messages.slice(0, -1), maxTokens })).text;

const TURNS = {
  a: [
    'Hello! Tell me a short story about a dragon and a knight who become friends.',
    'What was the name of the dragon?',
    'And the knight?',
  ],
  b: ['Привет! Расскажи мне короткую историю о драконе. 你好吗？', 'Quel temps fait-il aujourd’hui ?', 'Спасибо! 🙂'],
};

describe.each(['tiny', 'tiny-utf8'])('%s: conversations at once', (name) => {
  let ref: OneProcess;
  let proxyUrl: string;
  const closers: Array<() => unknown> = [];
  beforeAll(async () => {
    const gguf = modelPath(name, dir);
    ref = await OneProcess.load(gguf, CTX);
    const worker = { model: gguf, ...CTX, parallel: 2, bidirectionalKv: true, kvRecomputeThreshold: 16, kvSecret: 'k' };
    ({
      proxy: { url: proxyUrl },
    } = await serveTrio(closers, { prefill: worker, decode: worker }));
  }, 120_000);
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
    await ref?.close();
  });

  async function chat(messages: Message[], maxTokens: number, conversation: string) {
    const { status, json } = await postChat(proxyUrl, messages, maxTokens, conversation);
    expect(status, JSON.stringify(json)).toBe(200);
    return { text: json.choices[0].message.content as string, info: json.nixl_node as Json };
  }

  it('two conversations interleaved: each turn answers as node-llama-cpp alone', async () => {
    const run = async (turns: string[], conv: string) => {
      const messages: Message[] = [];
      const out: Array<{ messages: Message[]; text: string; reused: number }> = [];
      for (const [i, user] of turns.entries()) {
        messages.push({ role: 'user', content: user });
        const a = await chat(messages, 16 + 4 * i, conv);
        out.push({ messages: [...messages], text: a.text, reused: a.info.kv_reused_tokens ?? 0 });
        messages.push({ role: 'assistant', content: a.text });
      }
      return out;
    };
    const both = await Promise.all([run(TURNS.a, `${name}-a`), run(TURNS.b, `${name}-b`)]);
    for (const turns of both)
      for (const [i, t] of turns.entries())
        expect(t.text, `turn ${i + 1}`).toBe(await reference(ref, t.messages, 16 + 4 * i));
    // Reuse itself is not asserted: the prefill's own prefix cache may cover what a turn holds (`cached`).
  }, 300_000);

  it('one conversation_id, two clients at once with other histories: each answers its own messages', async () => {
    const conv = `${name}-shared`;
    const firsts = [TURNS.a[0], TURNS.b[0]];
    const ones = await Promise.all(firsts.map((f) => chat([{ role: 'user', content: f }], 16, conv)));
    const histories = firsts.map((f, i) => [
      { role: 'user', content: f },
      { role: 'assistant', content: ones[i].text },
      { role: 'user', content: 'Go on.' },
    ]);
    const twos = await Promise.all(histories.map((h) => chat(h, 12, conv)));
    for (const [i, h] of histories.entries()) {
      expect(ones[i].text).toBe(await reference(ref, h.slice(0, 1), 16));
      expect(twos[i].text).toBe(await reference(ref, h, 12));
    }
    // Again, one after the other, on the entry the last of them left.
    for (const h of histories) expect((await chat(h, 12, conv)).text).toBe(await reference(ref, h, 12));
  }, 300_000);
});

describe('tiny-utf8: unlucky turns through the proxy', () => {
  let ref: OneProcess;
  let proxyUrl: string;
  let encoder: ((text: string) => number[]) | undefined;
  const closers: Array<() => unknown> = [];
  beforeAll(async () => {
    const gguf = modelPath('tiny-utf8', dir);
    ref = await OneProcess.load(gguf, CTX);
    const worker = { model: gguf, ...CTX, parallel: 1, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const trio = await serveTrio(closers, { prefill: { ...worker, prefixCache: false }, decode: worker });
    proxyUrl = trio.proxy.url;
    encoder = trio.decode.model.tokenizer!.encode;
  }, 120_000);
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
    await ref?.close();
  });

  const chat = (messages: Message[], maxTokens: number, conversation: string) =>
    postChat(proxyUrl, messages, maxTokens, conversation);

  it('answers cut at max_tokens (mid-character), sent back as given or re-spaced or decomposed: turn 2 as node-llama-cpp alone', async () => {
    const first = 'Привет! Расскажи мне короткую историю о драконе. 你好吗？ Ça va ?';
    for (const maxTokens of [1, 2, 3, 5, 8]) {
      for (const edit of [(t: string) => t, (t: string) => `${t}  `, (t: string) => t.normalize('NFD')]) {
        const conv = `cut-${maxTokens}-${Math.random()}`;
        const a = await chat([{ role: 'user', content: first }], maxTokens, conv);
        expect(a.status, JSON.stringify(a.json)).toBe(200);
        const text = a.json.choices[0].message.content as string;
        const messages = [
          { role: 'user', content: first },
          { role: 'assistant', content: edit(text) },
          { role: 'user', content: 'Спасибо! 🙂' },
        ];
        const b = await chat(messages, 6, conv);
        expect(b.status, JSON.stringify(b.json)).toBe(200);
        expect(b.json.choices[0].message.content, `${maxTokens}: ${JSON.stringify(edit(text))}`).toBe(
          await reference(ref, messages, 6),
        );
      }
    }
  }, 300_000);

  it('sampled turns (temperature, seed, top_p, a stop string): turn 2 read or recomputed samples the same', async () => {
    const first = 'Привет! Расскажи мне короткую историю о драконе. 你好吗？ Ça va ?';
    const sampling = { temperature: 0.9, seed: 1234, top_p: 0.95, stop: ['!'] };
    const ask = async (messages: Message[], conversation?: string) => {
      const r = await fetch(`${proxyUrl}/v1/chat/completions`, {
        method: 'POST',
        body: JSON.stringify({
          messages,
          max_tokens: 12,
          ...sampling,
          ...(conversation ? { conversation_id: conversation } : {}),
        }),
      });
      const json = (await r.json()) as Json;
      expect(r.status, JSON.stringify(json)).toBe(200);
      return { text: json.choices[0].message.content as string, reused: json.nixl_node?.kv_reused_tokens ?? 0 };
    };
    const conv = `sampled-${Math.random()}`;
    const a = await ask([{ role: 'user', content: first }], conv);
    const messages = [
      { role: 'user', content: first },
      { role: 'assistant', content: a.text },
      { role: 'user', content: 'Спасибо! 🙂 Ещё?' },
    ];
    const b = await ask(messages, conv);
    expect(b.reused).toBeGreaterThan(0);
    expect(b.text).toBe((await ask(messages)).text);
  }, 120_000);

  it('token ids cut mid-character (the generate endpoint): turn 2 read or recomputed gives the same ids', async () => {
    const generate = async (ids: number[], maxTokens: number, conversation?: string) => {
      const r = await fetch(`${proxyUrl}/inference/v1/generate`, {
        method: 'POST',
        body: JSON.stringify({
          token_ids: ids,
          sampling_params: { max_tokens: maxTokens, temperature: 0 },
          ...(conversation ? { conversation_id: conversation } : {}),
        }),
      });
      const json = (await r.json()) as Json;
      expect(r.status, JSON.stringify(json)).toBe(200);
      return json.choices[0].token_ids as number[];
    };
    const encode = (t: string) => encoder!(t);
    const ids1 = encode('user: Привет! Расскажи мне историю о драконе. 你好吗？\nassistant:');
    for (const maxTokens of [1, 2, 3, 5]) {
      const conv = `ids-${maxTokens}-${Math.random()}`;
      const t1 = await generate(ids1, maxTokens, conv);
      const ids2 = [...ids1, ...t1, ...encode('\nuser: Спасибо! 🙂\nassistant:')];
      expect(await generate(ids2, 6, conv), `${maxTokens}`).toEqual(await generate(ids2, 6));
    }
  }, 120_000);

  it("a turn the prefill refuses (the last message not the user's) frees the hold it was given", async () => {
    // A decode of its own: no other test's holds come and go while it counts.
    const own: Array<() => unknown> = [];
    try {
      const worker = { model: modelPath('tiny-utf8', dir), ...CTX, parallel: 1, bidirectionalKv: true };
      const { proxy, decode } = await serveTrio(own, { prefill: worker, decode: worker });
      const send = async (messages: Message[]) => {
        const r = await fetch(`${proxy.url}/v1/chat/completions`, {
          method: 'POST',
          body: JSON.stringify({ messages, max_tokens: 8, temperature: 0, conversation_id: 'refused' }),
        });
        return { status: r.status, json: (await r.json()) as Json };
      };
      const a = await send([{ role: 'user', content: 'Привет!' }]);
      expect(a.status).toBe(200);
      await expect.poll(() => decode.turns!.held).toBe(1);
      const b = await send([
        { role: 'user', content: 'Привет!' },
        { role: 'assistant', content: a.json.choices[0].message.content },
      ]);
      expect(b.status).toBe(400);
      await expect.poll(() => decode.turns!.held).toBe(0);
    } finally {
      for (const c of own.reverse()) await c();
    }
  }, 120_000);
});

describe('tiny: one worker in both pools', () => {
  it('turn 2 reads the turn the same worker holds (copied in place) and answers as node-llama-cpp alone', async () => {
    const { startProxy, startWorker } = await import('../../lib/serving');
    const gguf = modelPath('tiny', dir);
    const ref = await OneProcess.load(gguf, CTX);
    const w = await startWorker({
      model: gguf,
      ...CTX,
      parallel: 2,
      prefixCache: false,
      bidirectionalKv: true,
      kvRecomputeThreshold: 16,
      kvSecret: 'k',
    });
    const proxy = await startProxy({ prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });
    try {
      const messages: Message[] = [];
      for (const [i, user] of TURNS.a.entries()) {
        messages.push({ role: 'user', content: user });
        const r = await fetch(`${proxy.url}/v1/chat/completions`, {
          method: 'POST',
          body: JSON.stringify({ messages, max_tokens: 16, temperature: 0, conversation_id: 'self' }),
        });
        const json = (await r.json()) as Json;
        expect(r.status, JSON.stringify(json)).toBe(200);
        const text = json.choices[0].message.content as string;
        const want = await ref.generate({ chat: true, text: user, history: messages.slice(0, -1), maxTokens: 16 });
        expect(text, `turn ${i + 1}`).toBe(want.text);
        if (i > 0) expect(json.nixl_node.kv_reused_tokens, `turn ${i + 1}`).toBeGreaterThan(0);
        messages.push({ role: 'assistant', content: text });
      }
      await expect.poll(() => w.turns!.held).toBe(1);
    } finally {
      await proxy.close();
      await w.close();
      await ref.close();
    }
  }, 120_000);
});
