// What a GGUF push decode registers (lib/serving/models/llama/push.ts): the
// size of the llama.cpp state a prefill saves, computed from the prompt's
// token count before anything is evaluated. It must equal, byte for byte,
// the state an honest prefill of the tiny and small test models saves
// (completions and chat, ASCII and not, one token to most of the context,
// contexts of other sizes), and the layouts llama.cpp can choose (V
// transposed or not, quantized caches) must size as the parser reads them.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { HEADER_BYTES } from '../../lib/serving/models/kv-state';
import { LlamaModel } from '../../lib/serving/models/llama';
import {
  checkOwnPrompt,
  evaluatedPrompt,
  promptRoom,
  pushSize,
  seqStateBytes,
  unpushable,
} from '../../lib/serving/models/llama/push';
import {
  type LlamaStateLayout,
  SEQ_MAGIC,
  SEQ_VERSION,
  ggmlRowSize,
  ggmlTypeSize,
  parseSeqState,
} from '../../lib/serving/models/llama/seq-state';
import { modelPath } from '../../lib/serving/models/test-models';
import { type GenerationRequest, KvRejected, ModelRequestError } from '../../lib/serving/models/types';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-push-size-'));
const BLOCK = 1 << 16;
const models: Record<string, LlamaModel> = {};

beforeAll(async () => {
  const load = (name: string, contextSize: number) =>
    LlamaModel.load({
      modelPath: modelPath(name, dir),
      contextSize,
      threads: 1,
      parallel: 1,
      blockBytes: BLOCK,
      poolBytes: 64 << 20,
    });
  models.tiny = await load('tiny', 512);
  models['tiny ctx 128'] = await load('tiny', 128);
  models.small = await load('small', 512);
}, 180_000);
afterAll(async () => {
  for (const m of Object.values(models)) await m.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

function request(chat: boolean, text: string, maxTokens = 1): GenerationRequest {
  return {
    chat,
    prompt: text,
    messages: chat
      ? [
          { role: 'system', content: 'Be brief.' },
          { role: 'user', content: text },
        ]
      : [],
    maxTokens,
    temperature: 0,
    stop: [],
  };
}

/** The state an honest prefill saves (the envelope taken off), and what it said of itself. */
async function prefill(m: LlamaModel, req: GenerationRequest) {
  const kv = await m.prefill(req, new AbortController().signal);
  const all = Buffer.alloc(kv.blocks * BLOCK);
  kv.writeTo((b) => all.subarray(b * BLOCK, (b + 1) * BLOCK), { engineId: 'e', requestId: 'r', blockIds: [] });
  const state = all.subarray(HEADER_BYTES, HEADER_BYTES + Number(all.readBigUInt64LE(16)));
  return { kv, state };
}

function layoutOf(m: LlamaModel): LlamaStateLayout {
  const l = m.stateLayout;
  if (typeof l === 'string') throw new Error(l);
  return l;
}

const texts = (ctx: number) => [
  '',
  'x',
  'the cat sat on a warm mat',
  'Grüße, 你好世界 🌍, Привет',
  'rain fell over quiet hills and rivers '.repeat(ctx > 128 ? 9 : 2),
  // Past promptRoom: LlamaCompletion cuts it from the start, LlamaChat would drop history.
  'y'.repeat(ctx - 8),
];

describe('the state a push decode sizes from the prompt is the one the prefill saves', () => {
  it.each(['tiny', 'tiny ctx 128', 'small'])('%s: every prompt, completion and chat', async (name) => {
    const m = models[name];
    const L = layoutOf(m);
    let cut = 0;
    for (const chat of [false, true])
      for (const text of texts(m.contextSize)) {
        const req = request(chat, text);
        // What the decode registers, before anything is evaluated (a 400 when it cannot know).
        let blocks = 0;
        let refused: unknown;
        try {
          blocks = m.pushBlocksFor(req);
        } catch (e) {
          refused = e;
        }
        let got: Awaited<ReturnType<typeof prefill>>;
        try {
          got = await prefill(m, req);
        } catch (e) {
          // Too long for the context at all: both sides answer the same 400.
          expect(e).toBeInstanceOf(ModelRequestError);
          expect(refused).toBeInstanceOf(ModelRequestError);
          continue;
        }
        const { kv, state } = got;
        const tokens = parseSeqState(state, L).tokens;
        if (refused) {
          // A chat LlamaChat evaluates only in part: the decode refused it, the prefill will not push it.
          expect(chat).toBe(true);
          expect(refused).toBeInstanceOf(ModelRequestError);
          expect(String(refused)).toMatch(/must fit whole/);
          expect(kv.unpushable).toMatch(/must fit whole/);
          continue;
        }
        if (tokens.length === promptRoom(L.nCtx) && text.startsWith('y')) cut++;
        expect(state.length, `${name} ${chat} ${JSON.stringify(text)}`).toBe(seqStateBytes(L, tokens.length));
        expect(kv.unpushable).toBeUndefined();
        expect(kv.whole).toBe(true);
        expect(kv.blocks).toBe(blocks);
        expect(pushSize(L, tokens.length, BLOCK).blocks).toBe(blocks);
      }
    // The completion past promptRoom was cut, and sized as cut (llama.cpp makes a context of 128 one of 256:
    // nothing that fits 128 reaches its room).
    expect(cut).toBe(promptRoom(L.nCtx) < m.contextSize - 8 ? 1 : 0);
  });

  it("the context's size does not change a state's size (only what fits)", async () => {
    const req = request(false, 'the same prompt in two contexts');
    const a = await prefill(models.tiny, req);
    const b = await prefill(models['tiny ctx 128'], req);
    expect(a.state.length).toBe(b.state.length);
  });

  it('a prompt that cannot fit with max_tokens is a 400 before any block is registered', () => {
    const m = models['tiny ctx 128'];
    expect(() => m.pushBlocksFor(request(false, 'y'.repeat(100), 64))).toThrow(ModelRequestError);
    expect(() => m.pushBlocksFor(request(false, 'y'.repeat(60), 64))).not.toThrow();
    expect(() => m.pushBlocksFor({ ...request(true, 'hi'), messages: [{ role: 'tool', content: 'x' }] })).toThrow(
      ModelRequestError,
    );
  });
});

describe('what each side checks', () => {
  it('the prefill: a state that is not what the decode computes is unpushable, saying why', () => {
    const L = layoutOf(models.tiny);
    const n = seqStateBytes(L, 3)!;
    expect(unpushable(L, [1, 2, 3], [1, 2, 3], n)).toBeUndefined();
    expect(unpushable(L, [1, 2, 3], [1, 2, 4], n)).toMatch(/not the 3 a decode computes/);
    expect(unpushable(L, [1, 2], [1, 2, 3], n)).toMatch(/3 tokens that are not the 2/);
    expect(unpushable(L, [1, 2, 3], [1, 2, 3], n + 1)).toMatch(/is \d+ bytes, a decode computes \d+/);
    expect(unpushable(L, undefined, [1], n)).toMatch(/no prompt tokens/);
    expect(unpushable('no layout', [1], [1], n)).toMatch(/cannot be checked/);
  });

  it('a prompt past the room node-llama-cpp leaves: a completion is cut behind its BOS, a chat is refused', () => {
    expect(promptRoom(100)).toBe(90);
    expect(promptRoom(5)).toBe(4);
    const t = Array.from({ length: 95 }, (_, i) => i);
    expect(evaluatedPrompt(t.slice(0, 90), { chat: false, contextSize: 100, bos: true })).toEqual(t.slice(0, 90));
    expect(evaluatedPrompt(t, { chat: false, contextSize: 100, bos: true })).toEqual([0, ...t.slice(-89)]);
    expect(evaluatedPrompt(t, { chat: false, contextSize: 100, bos: false })).toEqual(t.slice(-90));
    expect(evaluatedPrompt(t, { chat: true, contextSize: 100, bos: false })).toMatch(/must fit whole in 90/);
  });

  it("the decode: a state of another prompt's tokens is refused (wrong-request)", () => {
    expect(() => checkOwnPrompt([1, 2, 3], [1, 2, 3])).not.toThrow();
    for (const [state, prompt] of [
      [
        [1, 2, 3],
        [1, 2, 4],
      ],
      [
        [1, 2],
        [1, 2, 3],
      ],
      [[1, 2, 3], undefined],
    ] as const) {
      let e: unknown;
      try {
        checkOwnPrompt(state, prompt);
      } catch (x) {
        e = x;
      }
      expect(e).toBeInstanceOf(KvRejected);
      expect(e).toMatchObject({ reason: 'wrong-request', code: 'NIXL_ERR_MISMATCH' });
    }
  });
});

/** A state of `tokens` tokens for layout L, written field by field as llama.cpp writes it. */
function buildState(L: LlamaStateLayout, tokens: number): Buffer {
  const parts: Buffer[] = [];
  const u32 = (v: number) => {
    const b = Buffer.alloc(4);
    b.writeUInt32LE(v);
    parts.push(b);
  };
  const u64 = (v: number) => {
    const b = Buffer.alloc(8);
    b.writeBigUInt64LE(BigInt(v));
    parts.push(b);
  };
  u32(SEQ_MAGIC);
  u32(SEQ_VERSION);
  u32(tokens);
  for (let i = 0; i < tokens; i++) u32(i % L.nVocab);
  u32(1);
  u32(tokens);
  if (tokens === 0) return Buffer.concat(parts);
  for (let i = 0; i < tokens; i++) {
    u32(i);
    u32(1);
    u32(0);
  }
  u32(L.vTrans ? 1 : 0);
  u32(L.embdK.length);
  for (const w of L.embdK) {
    u32(L.kType);
    const row = ggmlRowSize(L.kType, w)!;
    u64(row);
    parts.push(Buffer.alloc(row * tokens));
  }
  for (const w of L.embdV) {
    u32(L.vType);
    if (!L.vTrans) {
      const row = ggmlRowSize(L.vType, w)!;
      u64(row);
      parts.push(Buffer.alloc(row * tokens));
    } else {
      const el = ggmlTypeSize(L.vType)!;
      u32(el);
      u32(w);
      parts.push(Buffer.alloc(w * tokens * el));
    }
  }
  return Buffer.concat(parts);
}

describe('every cache layout llama.cpp may choose sizes as the parser reads it', () => {
  const base = { nVocab: 300, nCtx: 4096, embdK: [64, 128, 64], embdV: [64, 64, 128] };
  it.each([
    ['F16, V not transposed', { kType: 1, vType: 1, vTrans: false }],
    ['F16, V transposed', { kType: 1, vType: 1, vTrans: true }],
    ['F32 K, Q8_0 V', { kType: 0, vType: 8, vTrans: false }],
    ['Q4_0 K, Q4_0 V transposed', { kType: 2, vType: 2, vTrans: true }],
    ['BF16', { kType: 30, vType: 30, vTrans: false }],
  ])('%s', (_, types) => {
    const L: LlamaStateLayout = { ...base, ...types };
    for (const n of [0, 1, 2, 17, 1000]) {
      const s = buildState(L, n);
      expect(parseSeqState(s, L).tokens).toHaveLength(n);
      expect(seqStateBytes(L, n)).toBe(s.length);
    }
  });

  it('a cache type it cannot size cannot be pushed (typed)', () => {
    const L: LlamaStateLayout = { ...base, kType: 99, vType: 1, vTrans: false };
    expect(seqStateBytes(L, 4)).toBeUndefined();
    expect(() => pushSize(L, 4, BLOCK)).toThrow(KvRejected);
  });
});
