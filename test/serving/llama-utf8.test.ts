// Real models writing pieces of characters: generated GGUFs whose greedy
// output is mostly bytes >= 0x80 (pieces of multi-byte UTF-8 characters, as
// byte-fallback vocabularies of real models write for any non-ASCII text)
// and one with an unbiased output layer, prompted in Chinese, Japanese,
// Russian, accented Latin, emoji and ASCII. Every answer through proxy ->
// prefill -> decode must equal node-llama-cpp generating alone: the text,
// each streamed chunk (whole characters, as its onTextChunk gives them),
// why it stopped, and the decode must continue from exactly where the state
// ends: it loaded the prompt's tokens and evaluated exactly the tokens one
// process evaluates after them.
//
// NIXL_NODE_LLAMA_PROMPTS=100 runs 100 prompts per model and transport
// (the default runs fewer, every script and mode still covered).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { type Ask, type Generation, OneProcess, askBody } from '../../demo/llama-reference';
import { WholeText } from '../../lib/serving/models/llama/text';
import { serveTrio } from '../helpers';

const CTX = { contextSize: 1024, threads: 1 };
const PROMPTS = Number(process.env.NIXL_NODE_LLAMA_PROMPTS ?? 12);
const SYSTEM = [{ role: 'system', content: 'Réponds brièvement. 简短回答。' }];
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-utf8-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

const SCRIPTS: Record<string, string[]> = {
  chinese: ['你好，世界', '数据中心的网络很快', '今天天气很好，我们去公园散步吧', '机器学习模型', '长城', '龙'],
  japanese: ['こんにちは、元気ですか', '東京は大きな都市です', 'カタカナとひらがな', '桜の花', '日本語'],
  russian: ['Привет, как дела?', 'Москва — столица России', 'быстрая коричневая лиса', 'Ёж', 'мир'],
  latin: ['café crème brûlée', 'Ça va très bien, merci', 'Ångström über naïve façade', 'El niño comió piñata', 'ß'],
  emoji: ['🙂🚀 launch', '🎉🎉 party time 🥳', '👨‍👩‍👧 family', '🇯🇵', '🔥'],
  ascii: ['the cat sat on the mat', 'hello', 'zz', 'Once upon a time', 'x'],
};
const NAMES = Object.keys(SCRIPTS);

/** Prompt i: every script in turn, one to four fragments, some mixed with the next script. */
function promptText(i: number): string {
  const own = SCRIPTS[NAMES[i % NAMES.length]];
  const other = SCRIPTS[NAMES[(i + 1) % NAMES.length]];
  const parts = Array.from({ length: 1 + (Math.floor(i / NAMES.length) % 4) }, (_, j) => own[(i + j) % own.length]);
  if (i % 5 === 4) parts.push(other[i % other.length]);
  return parts.join(i % 3 === 0 ? ' ' : '');
}

const MAX_TOKENS = [1, 2, 3, 5, 12, 16];
const STOPS = [undefined, undefined, undefined, ['s'], ['é', '\n'], [',']];

type Mode = 'completion' | 'stream' | 'chat' | 'chat-stream' | 'sampled' | 'chat-sampled-stream';
const MODES: Mode[] = ['completion', 'stream', 'chat', 'chat-stream', 'sampled', 'chat-sampled-stream'];

interface Case {
  ask: Ask;
  stream: boolean;
  label: string;
}

function cases(n: number): Case[] {
  const out: Case[] = [];
  for (let i = 0; i < n; i++)
    for (const [m, mode] of MODES.entries()) {
      const chat = mode.startsWith('chat');
      const k = i + m;
      out.push({
        label: `prompt ${i} (${mode}) ${JSON.stringify(promptText(i))}`,
        stream: mode.endsWith('stream'),
        ask: {
          chat,
          text: promptText(i),
          history: chat ? SYSTEM : undefined,
          maxTokens: MAX_TOKENS[k % MAX_TOKENS.length],
          stop: STOPS[(k * 7) % STOPS.length],
          ...(mode.includes('sampled') ? { temperature: 0.8, seed: 1000 + i } : {}),
        },
      });
    }
  return out;
}

interface Answer {
  status: number;
  text: string;
  chunks: string[];
  finish?: string;
  usage?: { prompt_tokens: number; completion_tokens: number };
  info?: Record<string, number | boolean | string>;
  error?: unknown;
}

async function ask(url: string, c: Case): Promise<Answer> {
  const res = await fetch(`${url}/v1/${c.ask.chat ? 'chat/completions' : 'completions'}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(askBody(c.ask, c.stream)),
  });
  if (!c.stream || res.status !== 200) {
    const j = (await res.json()) as {
      choices?: Array<{ text?: string; message?: { content: string }; finish_reason?: string }>;
      usage?: Answer['usage'];
      nixl_node?: Answer['info'];
      error?: unknown;
    };
    const ch = j.choices?.[0];
    const text = (c.ask.chat ? ch?.message?.content : ch?.text) ?? '';
    return {
      status: res.status,
      text,
      chunks: [text],
      finish: ch?.finish_reason,
      usage: j.usage,
      info: j.nixl_node,
      error: j.error,
    };
  }
  const chunks: string[] = [];
  let finish: string | undefined;
  let info: Answer['info'];
  for (const line of (await res.text()).split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    const ch = JSON.parse(line.slice(6));
    const t: string = (c.ask.chat ? ch.choices[0].delta.content : ch.choices[0].text) ?? '';
    if (t !== '') chunks.push(t);
    finish = ch.choices[0].finish_reason ?? finish;
    info = ch.nixl_node ?? info;
  }
  return { status: 200, text: chunks.join(''), chunks, finish, info };
}

/** Runs f over items, `limit` at a time. */
async function pool<T, R>(items: T[], limit: number, f: (t: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length);
  let next = 0;
  await Promise.all(
    Array.from({ length: limit }, async () => {
      while (next < items.length) {
        const i = next++;
        out[i] = await f(items[i]);
      }
    }),
  );
  return out;
}

/** A character split between chunks: a chunk ends in a high surrogate or starts with a low one. */
function splitsCharacter(chunks: string[]): boolean {
  return chunks.some((c) => /[\uD800-\uDBFF]$/.test(c) || /^[\uDC00-\uDFFF]/.test(c));
}

/**
 * node-llama-cpp's chunks as a stream of whole characters sends them: a
 * chunk never ends in U+FFFD (a character that may still complete), except
 * the last. The U+FFFD at the end of one of its chunks (pieces it releases
 * before a token of no text, or flushes when the generation ends) go with
 * the next chunk, or in a chunk of their own at the end.
 */
function wholeChunks(chunks: string[]): string[] {
  const out: string[] = [];
  let carry = '';
  for (const c of chunks) {
    const t = carry + c;
    const body = t.replace(/\uFFFD+$/, '');
    if (body !== '') out.push(body);
    carry = t.slice(body.length);
  }
  if (carry !== '') out.push(carry);
  return out;
}

function checkAnswer(c: Case, g: Answer, want: Generation): void {
  const why = `${c.label}: ${JSON.stringify(g.error ?? g.info)}`;
  expect(g.status, why).toBe(200);
  expect(g.text, why).toBe(want.text);
  expect(g.finish, why).toBe(want.finishReason);
  // Streamed: whole characters per chunk, adding up to the text above (g.text
  // is their concatenation), chunk by chunk as node-llama-cpp's onTextChunk
  // gives them where those are whole (see wholeChunks).
  if (c.stream && want.chunks.join('') === want.text) expect(g.chunks, why).toEqual(wholeChunks(want.chunks));
  expect(splitsCharacter(g.chunks), why).toBe(false);
  // The decode loaded the prompt's KV and continued exactly where it ends.
  expect(g.info?.kv_moved, why).toBe(true);
  expect(g.info?.kv_continued, why).toBe(true);
  expect(g.info?.kv_tokens_loaded, why).toBe(want.promptTokens);
  // Sampled: the token after the first is drawn with the stream's second draw
  // (llama-continue.ts), which evaluates the first token twice.
  const after = want.evaluatedTokens - want.promptTokens;
  expect(g.info?.tokens_evaluated, why).toBe(after + (c.ask.temperature && after > 0 ? 1 : 0));
  if (!c.stream) {
    expect(g.usage?.prompt_tokens, why).toBe(want.promptTokens);
    expect(g.usage?.completion_tokens, why).toBe(want.tokens);
  }
}

// What each model's answers must show, beyond pieces: whole non-ASCII
// characters (tiny-utf8), control bytes and ends of text (tiny-unbiased).
const MODELS = [
  { name: 'tiny-utf8', writes: (c: number) => c > 0x7f && c !== 0xfffd },
  { name: 'tiny-unbiased', writes: (c: number) => c < 0x20 && c !== 0x0a },
];

describe.each(MODELS)('$name: every answer equals one process', ({ name, writes }) => {
  let gguf: string;
  let ref: OneProcess;
  const want = new Map<string, Generation>();
  const all = cases(PROMPTS);

  beforeAll(async () => {
    gguf = modelPath(name, dir);
    ref = await OneProcess.load(gguf, CTX);
    for (const c of all) want.set(c.label, await ref.generate(c.ask));
  }, 600_000);
  afterAll(async () => {
    await ref?.close();
  });

  it('the model writes pieces of characters and the cases reach the rules that hold them back', () => {
    const texts = [...want.values()].map((w) => w.text);
    // Pieces node-llama-cpp left out (maxTokens) or wrote as U+FFFD, and whole non-ASCII characters.
    expect([...want.values()].some((w) => w.evaluatedTokens - w.promptTokens + 1 > w.tokens)).toBe(true);
    expect(texts.some((t) => [...t].some((ch) => writes(ch.codePointAt(0)!)))).toBe(true);
    expect(texts.some((t) => t.includes('\uFFFD'))).toBe(true);
    expect([...want.values()].some((w) => w.finishReason === 'stop')).toBe(true);
  });

  describe.each(['http', 'zmq'] as const)('over %s', (transport) => {
    const closers: Array<() => unknown> = [];
    afterAll(async () => {
      for (const f of closers.reverse()) await f();
    });

    it(`${PROMPTS} prompts x ${MODES.join(', ')}`, async () => {
      const w = { model: gguf, ...CTX, parallel: 2, blockBytes: 4096, blocks: 512 };
      const { proxy } = await serveTrio(closers, { transport, prefill: w, decode: w });
      const got = await pool(all, 4, (c) => ask(proxy.url, c));
      for (const [i, c] of all.entries()) checkAnswer(c, got[i], want.get(c.label)!);
    }, 600_000);
  });
});

it("a character split by a token of no text streams whole (node-llama-cpp's own chunks split it)", async () => {
  const ref = await OneProcess.load(modelPath('tiny-unbiased', dir), CTX);
  try {
    const byte = (b: number) => (b + 3) as import('node-llama-cpp').Token; // <0xNN> is token 3 + NN
    const unk = 0 as import('node-llama-cpp').Token;
    // U+0369 is CD A9; <unk> has no text. Released as node-llama-cpp released them in a generation.
    const groups = [
      [byte(0x4f), byte(0xcd), unk],
      [byte(0xa9), byte(0x6b)],
    ];
    const theirs = groups.map((g, i) => ref.model.detokenize(g, false, groups.slice(0, i).flat()));
    expect(theirs).toEqual(['O\uFFFD', '\uFFFDk']);
    const chunks: string[] = [];
    const text = new WholeText(ref.model, (c) => chunks.push(c));
    for (const g of groups) text.add(g);
    text.end(ref.model.detokenize(groups.flat(), false));
    expect(chunks).toEqual(['O', '\u0369k']);
  } finally {
    await ref.close();
  }
}, 60_000);
