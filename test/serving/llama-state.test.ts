// The parser a GGUF decode runs over every llama.cpp sequence state before
// llama.cpp sees it (lib/serving/models/llama/seq-state.ts): it accepts every
// state an honest prefill of the tiny and small test models saves
// (completions and chat, 1 token to a full context), and refuses, with a
// KvRejected, every state that is not one (each field, then random mutations:
// FUZZ_RUNS, default 20,000). An accepted mutation is always one that changed
// K / V values only: the length and every count and id are what an honest
// state of that many tokens has (sizes computed here independently).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SMALL, TINY, kvBytesPerToken, modelPath } from '../../lib/serving/models/test-models';
import type { GenerationRequest } from '../../lib/serving/models/types';
import { HEADER_BYTES } from '../../lib/serving/models/kv-state';
import { LlamaModel } from '../../lib/serving/models/llama';
import {
  type LlamaStateLayout,
  kvGeometry,
  learnLayout,
  parseSeqState,
} from '../../lib/serving/models/llama/seq-state';
import { loadNodeLlamaCpp } from '../../lib/serving/models/node-llama-cpp';
import { KvRejected } from '../../lib/serving/models/types';
import { kvRejectedReason as reason } from '../helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-state-'));
const CTX = 256;
const runs = Number(process.env.FUZZ_RUNS ?? 20000);
const models: Record<string, LlamaModel> = {};

beforeAll(async () => {
  for (const name of ['tiny', 'small'])
    models[name] = await LlamaModel.load({
      modelPath: modelPath(name, dir),
      contextSize: CTX,
      threads: 1,
      parallel: 1,
      blockBytes: 1 << 16,
      poolBytes: 64 << 20,
    });
}, 120_000);
afterAll(async () => {
  for (const m of Object.values(models)) await m.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

function request(chat: boolean, text: string): GenerationRequest {
  return { chat, prompt: text, messages: [{ role: 'user', content: text }], maxTokens: 1, temperature: 0, stop: [] };
}

/** The state an honest prefill of `m` saves for a prompt, as it travels (the envelope taken off). */
async function honestState(m: LlamaModel, chat: boolean, text: string): Promise<Buffer> {
  const kv = await m.prefill(request(chat, text), new AbortController().signal);
  const all = Buffer.alloc(kv.blocks * (1 << 16));
  kv.writeTo((b) => all.subarray(b * (1 << 16), (b + 1) * (1 << 16)), { engineId: 'e', requestId: 'r', blockIds: [0] });
  return all.subarray(HEADER_BYTES, HEADER_BYTES + Number(all.readBigUInt64LE(16)));
}

function layoutOf(m: LlamaModel): LlamaStateLayout {
  const l = m.stateLayout;
  if (typeof l === 'string') throw new Error(l);
  return l;
}

/** Bytes of an honest state of n tokens, from the model's spec (not from the parser). */
function honestSize(n: number, spec: typeof TINY): number {
  const kvRow = (spec.embedding / spec.heads) * spec.kvHeads * 2; // F16
  const perLayer = 4 + 8 + n * kvRow; // V: type, row size (or element size and width), data
  return 12 + 4 * n + 8 + (n ? 12 * n + 8 + spec.layers * (4 + 8 + n * kvRow) + spec.layers * perLayer : 0);
}

describe.each([
  ['tiny', TINY],
  ['small', SMALL],
] as const)('llama.cpp sequence states of the %s model', (name, spec) => {
  it('the layout comes from the GGUF and agrees with what llama.cpp saves', () => {
    const l = layoutOf(models[name]);
    expect(l.embdK).toEqual(Array(spec.layers).fill((spec.embedding / spec.heads) * spec.kvHeads));
    expect(l.embdV).toEqual(l.embdK);
    expect(l.nVocab).toBe(259);
    expect(l.nCtx).toBe(CTX);
    expect([l.kType, l.vType]).toEqual([1, 1]); // F16
    expect(kvBytesPerToken(spec)).toBe(2 * spec.layers * l.embdK[0] * 2);
  });

  it('every honest state parses: completions and chat, 1 token to a full context', async () => {
    const m = models[name];
    const l = layoutOf(m);
    const texts = ['', 'a', 'hello there', 'é ü 漢字 🙂', 'word '.repeat(30), 'x'.repeat(CTX - 6)];
    for (const chat of [false, true])
      for (const text of texts) {
        if (chat && text.length > CTX - 60) continue; // the chat template's own tokens
        const state = await honestState(m, chat, text);
        const p = parseSeqState(state, l);
        expect(p.cells).toBe(p.tokens.length);
        expect(state.length).toBe(honestSize(p.tokens.length, spec));
        expect(p.tokens.every((t) => t < l.nVocab)).toBe(true);
      }
  }, 60_000);
});

it("a prefill's state is sealed into blocks once: its buffer goes back to be used again, so a second writeTo throws", async () => {
  const m = models.tiny;
  const kv = await m.prefill(request(false, 'sealed once'), new AbortController().signal);
  const all = Buffer.alloc(kv.blocks * (1 << 16));
  const view = (b: number) => all.subarray(b * (1 << 16), (b + 1) * (1 << 16));
  const binding = { engineId: 'e', requestId: 'r', blockIds: [0] };
  kv.writeTo(view, binding);
  const first = Buffer.from(all);
  // The next prefill may take the same buffer: the first state must not be sealed again from it.
  await m.prefill(request(false, 'another prompt, another state'), new AbortController().signal);
  expect(() => kv.writeTo(view, binding)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
  expect(all.equals(first)).toBe(true);
});

it('both V layouts: with flash attention (V by rows) and without (V transposed), states parse', async () => {
  const nlc = await loadNodeLlamaCpp();
  const llama = await nlc.getLlama({ gpu: false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
  const model = await llama.loadModel({ modelPath: modelPath('small', dir) });
  const seen: boolean[] = [];
  try {
    for (const flashAttention of [false, true]) {
      const ctx = await model.createContext({ contextSize: CTX, threads: 1, flashAttention });
      const save = async (text: string) => {
        const seq = ctx.getSequence();
        await seq.evaluateWithoutGeneratingNewTokens(model.tokenize(text));
        const file = path.join(dir, `flash-${flashAttention}.state`);
        await seq.saveStateToFile(file);
        seq.dispose();
        return fs.readFileSync(file);
      };
      const geometry = kvGeometry(model.fileInfo.metadata)!;
      const l = learnLayout(await save('ab'), geometry, 259, CTX);
      seen.push(l.vTrans);
      const state = await save('word '.repeat(20));
      expect(parseSeqState(state, l).tokens.length).toBe(state.readUInt32LE(8));
      expect(state.length).toBe(honestSize(state.readUInt32LE(8), SMALL));
      // A state of the other layout is refused.
      expect(reason(() => parseSeqState(state, { ...l, vTrans: !l.vTrans }))).toBe('malformed');
      await ctx.dispose();
    }
  } finally {
    await model.dispose();
  }
  expect(seen).toEqual([true, false]);
}, 60_000);

describe('a state that is not one an honest prefill saves is refused', () => {
  let state: Buffer;
  let l: LlamaStateLayout;
  let n: number;
  beforeAll(async () => {
    state = await honestState(models.tiny, false, 'the cat sat on the mat');
    l = layoutOf(models.tiny);
    n = state.readUInt32LE(8);
  }, 30_000);
  const edit = (f: (b: Buffer) => void): Buffer => {
    const b = Buffer.from(state);
    f(b);
    return b;
  };
  const cell = (i: number) => 12 + 4 * n + 8 + 12 * i;
  const afterCells = () => 12 + 4 * n + 8 + 12 * n;

  it.each([
    ['another magic', (b: Buffer) => b.writeUInt32LE(0x67677372, 0), 'malformed'],
    ['another version', (b: Buffer) => b.writeUInt32LE(2, 4), 'malformed'],
    ['a token outside the vocabulary', (b: Buffer) => b.writeUInt32LE(259, 12 + 4), 'malformed'],
    ['a negative token', (b: Buffer) => b.writeInt32LE(-1, 12), 'malformed'],
    ['more tokens than the context', (b: Buffer) => b.writeUInt32LE(CTX + 1, 8), 'oversized'],
    ['a token count of 2^32-1', (b: Buffer) => b.writeUInt32LE(0xffffffff, 8), 'oversized'],
    ['one token fewer', (b: Buffer) => b.writeUInt32LE(n - 1, 8), 'malformed'],
    ['two streams', (b: Buffer) => b.writeUInt32LE(2, 12 + 4 * n), 'malformed'],
    ['a cell count of 2^31', (b: Buffer) => b.writeUInt32LE(2 ** 31, 16 + 4 * n), 'oversized'],
    ['a cell count of the context', (b: Buffer) => b.writeUInt32LE(CTX, 16 + 4 * n), 'malformed'],
    ['a cell count of 0', (b: Buffer) => b.writeUInt32LE(0, 16 + 4 * n), 'malformed'],
    ['a position of 2^31-1', (b: Buffer) => b.writeInt32LE(0x7fffffff, cell(n - 1)), 'malformed'],
    ['a negative position', (b: Buffer) => b.writeInt32LE(-1, cell(0)), 'malformed'],
    [
      'two positions swapped',
      (b: Buffer) => {
        b.writeInt32LE(1, cell(0));
        b.writeInt32LE(0, cell(1));
      },
      'malformed',
    ],
    ['a cell in two sequences', (b: Buffer) => b.writeUInt32LE(2, cell(0) + 4), 'malformed'],
    ['a cell of sequence 1', (b: Buffer) => b.writeInt32LE(1, cell(0) + 8), 'malformed'],
    ['the other V transposition', (b: Buffer) => b.writeUInt32LE(l.vTrans ? 0 : 1, afterCells()), 'malformed'],
    ['one layer more', (b: Buffer) => b.writeUInt32LE(3, afterCells() + 4), 'malformed'],
    ['an F32 K cache', (b: Buffer) => b.writeInt32LE(0, afterCells() + 8), 'malformed'],
    ['a longer K row', (b: Buffer) => b.writeBigUInt64LE(130n, afterCells() + 12), 'malformed'],
    ['a K row of 2^63', (b: Buffer) => b.writeBigUInt64LE(1n << 63n, afterCells() + 12), 'malformed'],
  ])('%s', (_, f, why) => {
    expect(reason(() => parseSeqState(edit(f), l))).toBe(why);
  });

  it('one byte short, one byte more, nothing at all', () => {
    expect(reason(() => parseSeqState(state.subarray(0, state.length - 1), l))).toBe('truncated');
    expect(reason(() => parseSeqState(Buffer.concat([state, Buffer.alloc(1)]), l))).toBe('malformed');
    expect(reason(() => parseSeqState(Buffer.alloc(0), l))).toBe('truncated');
    for (let cut = 0; cut < state.length; cut += 97)
      expect(reason(() => parseSeqState(state.subarray(0, cut), l))).not.toBe('accepted');
  });

  it('a state for a smaller context, or a smaller vocabulary: refused', () => {
    expect(reason(() => parseSeqState(state, { ...l, nCtx: n - 1 }))).toBe('oversized');
    const max = Math.max(...parseSeqState(state, l).tokens);
    expect(reason(() => parseSeqState(state, { ...l, nVocab: max }))).toBe('malformed');
  });

  it(`random mutations (${runs}): a KvRejected, or only K / V values changed`, () => {
    const sizes = [0, 1, 2, 4, 8, 12, 16, 64, 130];
    const values = [0, 1, 2, n - 1, n, n + 1, 255, 258, 259, CTX, CTX + 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1];
    const mutation = fc.oneof(
      // Bytes changed at random.
      fc.record({ at: fc.nat(state.length - 1), x: fc.integer({ min: 1, max: 255 }), k: fc.constant('flip' as const) }),
      // A u32 set to a value that means something somewhere.
      fc.record({ at: fc.nat(state.length - 4), v: fc.constantFrom(...values), k: fc.constant('u32' as const) }),
      // Cut, or grown, or bytes removed or inserted in the middle.
      fc.record({ len: fc.constantFrom(...sizes), k: fc.constantFrom('cut', 'grow', 'remove', 'insert') }),
    );
    const structure = state.subarray(0, afterCells() + 8);
    fc.assert(
      fc.property(mutation, fc.nat(state.length - 1), (m, at) => {
        const b = Buffer.from(state);
        let out = b;
        if (m.k === 'flip') b[m.at] ^= m.x;
        else if (m.k === 'u32') b.writeUInt32LE(m.v >>> 0, m.at);
        else if (m.k === 'cut') out = b.subarray(0, b.length - m.len - 1);
        else if (m.k === 'grow') out = Buffer.concat([b, Buffer.alloc(m.len + 1, 7)]);
        else if (m.k === 'remove') out = Buffer.concat([b.subarray(0, at), b.subarray(at + m.len + 1)]);
        else out = Buffer.concat([b.subarray(0, at), Buffer.alloc(m.len + 1, 9), b.subarray(at)]);
        let p: ReturnType<typeof parseSeqState>;
        try {
          p = parseSeqState(out, l);
        } catch (e) {
          expect(e).toBeInstanceOf(KvRejected);
          return;
        }
        // Accepted: an honest state's shape, so only values in K / V (or an in-vocabulary token) changed.
        expect(out.length).toBe(honestSize(p.tokens.length, TINY));
        expect(p.cells).toBe(p.tokens.length);
        expect(p.tokens.every((t) => t < 259)).toBe(true);
        expect(out.subarray(12 + 4 * n, afterCells() + 8).equals(structure.subarray(12 + 4 * n))).toBe(true);
      }),
      { numRuns: runs, seed: Number(process.env.FUZZ_SEED ?? 30) },
    );
  }, 120_000);
});
