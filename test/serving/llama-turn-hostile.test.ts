// Hostile and unlucky previous-turn params sent straight to a GGUF prefill
// (no proxy in front): another conversation's held turn, a replay of a turn
// already read (its blocks since given to another conversation's hold),
// counts that lie, blocks out of range, a decode gone. Each answer is
// node-llama-cpp's alone for the request's own messages; what the params
// name of another conversation is never loaded (docs/multiturn.md).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { OneProcess } from '../../demo/llama-reference';
import { type Worker, startWorker } from '../../lib/serving';
import { PREFIX_DIGEST_KEY, PREFIX_TOKENS_KEY, tokensDigest } from '../../lib/kv/turn-params';
import { modelPath } from '../../lib/serving/models/test-models';
import { ggufTrio } from './gguf-trio';

const CTX = { contextSize: 1024, threads: 1, batchSize: 16 };
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-turn-hostile-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

// biome-ignore lint/suspicious/noExplicitAny: answers are JSON read field by field
type Json = Record<string, any>;
type Message = { role: string; content: string };

const FIRST = 'Hello! Tell me a short story about a dragon and a knight who become friends.';
const OTHER = 'Good morning. Can you explain how bread is made, step by step, for a beginner?';

async function post(url: string, body: Json): Promise<{ status: number; json: Json }> {
  const r = await fetch(`${url}/v1/chat/completions`, { method: 'POST', body: JSON.stringify(body) });
  return { status: r.status, json: (await r.json()) as Json };
}

/**
 * One chat turn: the prefill with `previous` (a held turn's params; else a
 * fresh do_remote_decode), then the decode unless there is none. Both answer
 * 200. Its text, the prefill's nixl_node, the decode's turn params.
 */
async function chatTurn(
  prefill: Worker,
  decode: Worker | undefined,
  messages: Message[],
  maxTokens: number,
  previous?: Json,
) {
  const body = { messages, max_tokens: maxTokens, temperature: 0 };
  const pre = await post(prefill.address, { ...body, kv_transfer_params: previous ?? { do_remote_decode: true } });
  expect(pre.status, JSON.stringify(pre.json)).toBe(200);
  const info = pre.json.nixl_node as Json;
  if (!decode) return { prefill: info, text: undefined, params: undefined };
  const dec = await post(decode.address, { ...body, kv_transfer_params: pre.json.kv_transfer_params });
  expect(dec.status, JSON.stringify(dec.json)).toBe(200);
  return {
    text: dec.json.choices[0].message.content as string,
    prefill: info,
    params: dec.json.kv_transfer_params as Json | undefined,
  };
}

describe.each([
  ['without a KV secret', undefined],
  ['with a KV secret', 's3cret'],
] as const)('GGUF previous-turn params, hostile, straight to the prefill (%s)', (_, kvSecret) => {
  const g = ggufTrio(dir, CTX, (gguf) => {
    const w = {
      model: gguf,
      ...CTX,
      parallel: 1,
      bidirectionalKv: true,
      kvRecomputeThreshold: 16,
      ...(kvSecret ? { kvSecret } : {}),
    };
    return { prefill: { ...w, prefixCache: false }, decode: w };
  });

  async function reference(messages: Message[], maxTokens: number): Promise<string> {
    const last = messages.at(-1)!;
    return (await g.ref.generate({ chat: true, text: last.content, history: messages.slice(0, -1), maxTokens })).text;
  }

  const turn = (messages: Message[], maxTokens: number, previous?: Json) =>
    chatTurn(g.prefill, g.decode, messages, maxTokens, previous);

  /** Turn 1 of a conversation, and the messages of its turn 2. */
  async function opened(first: string, second: string) {
    const a = await turn([{ role: 'user', content: first }], 16);
    expect(a.params).toBeDefined();
    const messages = [
      { role: 'user', content: first },
      { role: 'assistant', content: a.text! },
      { role: 'user', content: second },
    ];
    return { params: a.params!, messages };
  }

  it("another conversation's held turn is never loaded, and its hold stays for its own next turn", async () => {
    const a = await opened(FIRST, 'What was the name of the dragon?');
    const b = await opened(OTHER, 'Why does the dough rise?');
    // B's turn 2 given A's params.
    const x = await turn(b.messages, 12, a.params);
    expect(x.text).toBe(await reference(b.messages, 12));
    expect(x.prefill.kv_reused_tokens ?? 0).toBe(0);
    // A's turn 2, with its own params: read (the hold was kept).
    const y = await turn(a.messages, 12, a.params);
    expect(y.text).toBe(await reference(a.messages, 12));
    expect(y.prefill.kv_reuse_skipped).toBeUndefined();
    expect(y.prefill.kv_reused_tokens).toBeGreaterThan(0);
    // B's own turn 2 still reads B's hold.
    const z = await turn(b.messages, 12, b.params);
    expect(z.text).toBe(x.text);
    expect(z.prefill.kv_reused_tokens).toBeGreaterThan(0);
  }, 120_000);

  it("A's params with the digest and counts of B's prompt: what A holds beyond the shared prefix is never loaded", async () => {
    // B shares A's first message but not A's answer: only the shared whole batches may come from A's state.
    const a = await opened(FIRST, 'What was the name of the dragon?');
    const bMessages = [
      { role: 'user', content: FIRST },
      { role: 'assistant', content: 'Once upon a time a dragon named Ember met a knight named Sir Alder at a river.' },
      { role: 'user', content: 'What was the name of the dragon?' },
    ];
    const bPrompt = g.prefill.model.promptTokenIds!({
      chat: true,
      messages: bMessages,
    } as never) as number[];
    const held = a.params[PREFIX_TOKENS_KEY] as number;
    const n = Math.min(held, bPrompt.length - 1);
    const forged = {
      ...a.params,
      remote_num_tokens: n,
      [PREFIX_TOKENS_KEY]: n,
      [PREFIX_DIGEST_KEY]: tokensDigest(bPrompt.slice(0, n)),
    };
    const x = await turn(bMessages, 12, forged);
    expect(x.text).toBe(await reference(bMessages, 12));
    if (kvSecret) expect(x.prefill.kv_reuse_skipped).toBe('unauthenticated');
    else expect(x.prefill.kv_reused_tokens ?? 0).toBeLessThanOrEqual(Math.floor(FIRST.length / 16) * 16 + 64);
  }, 120_000);

  it('a replay of a turn already read, its blocks since held for another conversation, reads nothing of it', async () => {
    const a = await opened(FIRST, 'What was the name of the dragon?');
    const y = await turn(a.messages, 12, a.params);
    expect(y.prefill.kv_reused_tokens).toBeGreaterThan(0);
    // C's turn 1: its hold may take the blocks A's hold had.
    const c = await opened(OTHER, 'Why does the dough rise?');
    const replay = await turn(a.messages, 12, a.params);
    expect(replay.text).toBe(y.text);
    expect(replay.prefill.kv_reused_tokens ?? 0).toBe(0);
    expect(replay.prefill.kv_reuse_skipped).toBeDefined();
    // C's hold was not freed by the replay: its turn 2 reads it.
    const z = await turn(c.messages, 12, c.params);
    expect(z.text).toBe(await reference(c.messages, 12));
    expect(z.prefill.kv_reused_tokens).toBeGreaterThan(0);
  }, 120_000);

  it('one held turn read by two turns at once while a third conversation takes blocks: each answer its own', async () => {
    const a = await opened(FIRST, 'What was the name of the dragon?');
    const want = await reference(a.messages, 12);
    const [x, y, c] = await Promise.all([
      turn(a.messages, 12, a.params),
      turn(a.messages, 12, a.params),
      turn([{ role: 'user', content: OTHER }], 16),
    ]);
    expect(x.text).toBe(want);
    expect(y.text).toBe(want);
    expect(c.text).toBe(await reference([{ role: 'user', content: OTHER }], 16));
  }, 120_000);

  it('lying counts, blocks out of range, a decode that is not there: recomputed, the same answer', async () => {
    const a = await opened(FIRST, 'What was the name of the dragon?');
    const want = await reference(a.messages, 12);
    const ids = (a.params.remote_block_ids as number[][] | number[]).flat() as number[];
    const forgeries: Array<[string, Json]> = [
      ['remote_num_tokens huge', { remote_num_tokens: 2 ** 40 }],
      ['remote_num_tokens negative', { remote_num_tokens: -16 }],
      ['remote_num_tokens fractional', { remote_num_tokens: 16.5 }],
      ['remote_num_tokens a string', { remote_num_tokens: '64' }],
      ['prefix tokens huge', { [PREFIX_TOKENS_KEY]: 2 ** 53 + 2 }],
      ['prefix tokens more than the blocks', { [PREFIX_TOKENS_KEY]: 10_000, remote_num_tokens: 10_000 }],
      ['block ids out of range', { remote_block_ids: [[...ids.slice(0, -1), 1 << 30]] }],
      ['negative block id', { remote_block_ids: [[-1, ...ids.slice(1)]] }],
      ['a block id twice', { remote_block_ids: [[ids[0], ids[0], ...ids.slice(2)]] }],
      ['a huge block list', { remote_block_ids: [Array.from({ length: 60_000 }, (_, i) => i)] }],
      ['blocks as a flat string', { remote_block_ids: 'all' }],
      ['another engine', { remote_engine_id: 'nobody' }],
      ['the prefill itself as the engine', { remote_engine_id: g.prefill.name }],
      ['a port nobody listens on', { remote_port: 1 }],
      ['expired long ago', { remote_blocks_expiry_time: 1 }],
      ['a digest of nothing', { [PREFIX_DIGEST_KEY]: tokensDigest([]) }],
    ];
    for (const [what, change] of forgeries) {
      const x = await turn(a.messages, 12, { ...a.params, ...change });
      expect(x.text, what).toBe(want);
      expect(x.prefill.kv_reused_tokens ?? 0, what).toBe(0);
    }
    // With a secret, none of them was read, so the hold stays for its own turn 2 (without one, params are
    // trusted as vLLM trusts them: a read of the hold's id, whatever it proves, frees it).
    const y = await turn(a.messages, 12, a.params);
    expect(y.text).toBe(want);
    if (kvSecret) expect(y.prefill.kv_reused_tokens).toBeGreaterThan(0);
  }, 300_000);
});

describe('GGUF held turns that end or go before the next turn reads them (tiny)', () => {
  let ref: OneProcess;
  const closers: Array<() => unknown> = [];
  beforeAll(async () => {
    ref = await OneProcess.load(modelPath('tiny', dir), CTX);
  }, 120_000);
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
    await ref?.close();
  });

  async function pair(decodeOptions: Json = {}) {
    const w = { model: modelPath('tiny', dir), ...CTX, parallel: 1, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const prefill = await startWorker({ ...w, prefixCache: false });
    const decode = await startWorker({ ...w, ...decodeOptions });
    closers.push(
      () => prefill.close(),
      () => decode.close(),
    );
    return { prefill, decode };
  }

  async function turn1(prefill: Worker, decode: Worker) {
    const a = await chatTurn(prefill, decode, [{ role: 'user', content: FIRST }], 16);
    expect(a.params).toBeDefined();
    const messages = [
      { role: 'user', content: FIRST },
      { role: 'assistant', content: a.text! },
      { role: 'user', content: 'What was the name of the dragon?' },
    ];
    return { params: a.params!, messages };
  }

  async function turn2(prefill: Worker, decode: Worker | undefined, messages: Message[], params: Json) {
    const b = await chatTurn(prefill, decode, messages, 12, params);
    return { info: b.prefill, text: b.text };
  }

  const reference = async (messages: Message[]) =>
    (await ref.generate({ chat: true, text: messages[2].content, history: messages.slice(0, 2), maxTokens: 12 })).text;

  it('a hold past its TTL is not read: recomputed, the same answer', async () => {
    const { prefill, decode } = await pair({ decoderKvTtlMs: 50 });
    const a = await turn1(prefill, decode);
    await expect.poll(() => decode.turns!.held, { timeout: 10_000 }).toBe(0);
    const b = await turn2(prefill, decode, a.messages, a.params);
    expect(b.info.kv_reused_tokens ?? 0).toBe(0);
    expect(b.info.kv_reuse_skipped).toMatch(/^pull-failed:/);
    expect(b.text).toBe(await reference(a.messages));
  }, 120_000);

  it('a decode closed after holding a turn: the prefill recomputes, the same answer', async () => {
    const { prefill, decode } = await pair();
    const a = await turn1(prefill, decode);
    await decode.close();
    const b = await turn2(prefill, undefined, a.messages, a.params);
    expect(b.info.kv_reused_tokens ?? 0).toBe(0);
    expect(b.info.kv_reuse_skipped).toMatch(/^pull-failed:/);
    // Its KV, decoded on a fresh decode, answers as node-llama-cpp alone.
    const { decode: other } = await pair();
    const body = { messages: a.messages, max_tokens: 12, temperature: 0 };
    const pre = await post(prefill.address, { ...body, kv_transfer_params: a.params });
    expect(pre.json.nixl_node.kv_reused_tokens ?? 0).toBe(0);
    const dec = await post(other.address, { ...body, kv_transfer_params: pre.json.kv_transfer_params });
    expect(dec.json.choices[0].message.content).toBe(await reference(a.messages));
  }, 120_000);
});

describe.each([3_600_000, -3_600_000])('GGUF turns, the decode clock %d ms off the prefill', (skew) => {
  it("turn 2 reads turn 1 inside the decode's hold (expiry mapped through the handshake), as node-llama-cpp alone", async () => {
    const gguf = modelPath('tiny', dir);
    const ref = await OneProcess.load(gguf, CTX);
    const w = { model: gguf, ...CTX, parallel: 1, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const prefill = await startWorker({ ...w, prefixCache: false });
    const decode = await startWorker({ ...w, testHooks: { clockSkewMs: skew } });
    try {
      const a = await chatTurn(prefill, decode, [{ role: 'user', content: FIRST }], 12);
      const messages = [
        { role: 'user', content: FIRST },
        { role: 'assistant', content: a.text! },
        { role: 'user', content: 'What was the name of the dragon?' },
      ];
      const b = await chatTurn(prefill, decode, messages, 12, a.params);
      expect(b.prefill.kv_reuse_skipped).toBeUndefined();
      expect(b.prefill.kv_reused_tokens).toBeGreaterThan(0);
      expect(b.text).toBe(
        (await ref.generate({ chat: true, text: messages[2].content, history: messages.slice(0, 2), maxTokens: 12 }))
          .text,
      );
    } finally {
      await prefill.close();
      await decode.close();
      await ref.close();
    }
  }, 120_000);
});

describe('GGUF turns near the end of the context (tiny, 256 tokens)', () => {
  it("turn 2 past the room node-llama-cpp leaves (LlamaChat drops history): the held turn's prefix read, as node-llama-cpp alone", async () => {
    const small = { contextSize: 256, threads: 1, batchSize: 16 };
    const gguf = modelPath('tiny', dir);
    const ref = await OneProcess.load(gguf, small);
    const w = { model: gguf, ...small, parallel: 1, bidirectionalKv: true, kvRecomputeThreshold: 16 };
    const prefill = await startWorker({ ...w, prefixCache: false });
    const decode = await startWorker(w);
    try {
      const first = 'Tell me a story about a dragon and a knight who meet at a river and become friends over time.';
      const a = await chatTurn(prefill, decode, [{ role: 'user', content: first }], 40);
      let second = 'And then?';
      const messages = () => [
        { role: 'user', content: first },
        { role: 'assistant', content: a.text! },
        { role: 'user', content: second },
      ];
      const length = () => prefill.model.promptTokenIds!({ chat: true, messages: messages() } as never).length;
      while (length() < 236) second += ' More, please.';
      expect(length()).toBeLessThanOrEqual(248);
      const b = await chatTurn(prefill, decode, messages(), 6, a.params);
      const want = await ref.generate({ chat: true, text: second, history: messages().slice(0, 2), maxTokens: 6 });
      expect(b.text).toBe(want.text);
    } finally {
      await prefill.close();
      await decode.close();
      await ref.close();
    }
  }, 120_000);
});
