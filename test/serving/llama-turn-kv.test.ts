// Which of a GGUF decode's KV a next turn could reuse without changing a
// number. A decode holds the prompt's KV (the prefill's: whole batches of
// the context's batchSize B from position 0) and then evaluates its answer
// one token at a time (batches of 1). A fresh prefill of the next turn's
// prompt, which starts with that prompt and answer, evaluates all of it in
// batches of B. llama.cpp on CPU gives K / V other last bits depending on the
// batch a token is evaluated in, so only the prompt's whole batches are
// provably a fresh prefill's: this test pins that part (it must be
// identical) and measures how much of the rest is not (docs/multiturn.md).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  type LlamaStateLayout,
  ggmlRowSize,
  ggmlTypeSize,
  kvGeometry,
  learnLayout,
  truncateSeqState,
} from '../../lib/serving/models/llama/seq-state';
import { loadNodeLlamaCpp } from '../../lib/serving/models/node-llama-cpp';
import { modelPath } from '../../lib/serving/models/test-models';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-turn-kv-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

/** Positions whose K or V (any layer) differ between two states of the same tokens. */
function differingPositions(a: Buffer, b: Buffer, L: LlamaStateLayout): number[] {
  const cellsAt = (s: Buffer) => {
    const n = s.readUInt32LE(8);
    return { cells: s.readUInt32LE(12 + 4 * n + 4), kvAt: 12 + 4 * n + 8 + 12 * s.readUInt32LE(12 + 4 * n + 4) + 8 };
  };
  const { cells, kvAt } = cellsAt(a);
  expect(cellsAt(b).cells).toBe(cells);
  expect(a.length).toBe(b.length);
  const diff = new Set<number>();
  let at = kvAt;
  for (let l = 0; l < L.embdK.length; l++) {
    const row = ggmlRowSize(L.kType, L.embdK[l]) as number;
    at += 12;
    for (let i = 0; i < cells; i++)
      if (!a.subarray(at + i * row, at + (i + 1) * row).equals(b.subarray(at + i * row, at + (i + 1) * row)))
        diff.add(i);
    at += row * cells;
  }
  for (let l = 0; l < L.embdV.length; l++) {
    if (!L.vTrans) {
      const row = ggmlRowSize(L.vType, L.embdV[l]) as number;
      at += 12;
      for (let i = 0; i < cells; i++)
        if (!a.subarray(at + i * row, at + (i + 1) * row).equals(b.subarray(at + i * row, at + (i + 1) * row)))
          diff.add(i);
      at += row * cells;
    } else {
      const el = ggmlTypeSize(L.vType) as number;
      at += 12;
      for (let j = 0; j < L.embdV[l]; j++)
        for (let i = 0; i < cells; i++) {
          const o = at + (j * cells + i) * el;
          if (!a.subarray(o, o + el).equals(b.subarray(o, o + el))) diff.add(i);
        }
      at += L.embdV[l] * cells * el;
    }
  }
  expect(at).toBe(a.length);
  return [...diff].sort((x, y) => x - y);
}

const PROMPTS: Record<string, string[]> = {
  tiny: [
    'You are a careful assistant. Answer in one short sentence. What is 2+2? ',
    'The quick brown fox jumps over the lazy dog, and then it rests for a while under the old oak tree. ',
    'user: Hi there, can you tell me a story about a dragon and a knight who become friends?\nassistant:',
  ],
  'tiny-utf8': [
    '你是一个认真的助手。请用一句话回答，务必准确。Réponds brièvement. ',
    'Привет! Как дела? Расскажи мне короткую историю о драконе. ',
    'user: 今天天气怎么样？ Quel temps fait-il ?\nassistant:',
  ],
};

describe.each(['tiny', 'tiny-utf8'])('%s: the KV a decode holds after answering, against a fresh prefill', (name) => {
  let nlc: typeof Nlc;
  let llama: Nlc.Llama;
  let model: Nlc.LlamaModel;
  beforeAll(async () => {
    nlc = await loadNodeLlamaCpp();
    llama = await nlc.getLlama({ gpu: false, build: 'never' });
    model = await llama.loadModel({ modelPath: modelPath(name, dir) });
  }, 120_000);
  afterAll(async () => {
    await model?.dispose();
  });

  /** The state `seq` holds, as llama.cpp saves it. */
  async function state(seq: Nlc.LlamaContextSequence, file: string): Promise<Buffer> {
    await seq.saveStateToFile(file);
    return fs.readFileSync(file);
  }

  it.each([16, 64])(
    'batch %i: the prompt whole batches are identical, the rest once evaluated again in batches; the answer is measured',
    async (batch) => {
      const geometry = kvGeometry(model.fileInfo.metadata) as { embdK: number[]; embdV: number[] };
      const nVocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
      const rows: string[] = [];
      for (const [k, prompt] of PROMPTS[name].entries()) {
        const p = model.tokenize(prompt, false) as Nlc.Token[];
        // The decode: the prompt in whole batches from 0 (as its prefill), then an answer token by token.
        const dctx = await model.createContext({ contextSize: 512, batchSize: batch, threads: 1, sequences: 1 });
        const dseq = dctx.getSequence();
        let n = 0;
        for await (const _t of dseq.evaluate(p, { temperature: 0 })) if (++n >= 24) break;
        const held = [...dseq.contextTokens];
        expect(held.slice(0, p.length)).toEqual(p);
        const decoded = await state(dseq, path.join(dir, `${name}-${batch}-${k}-d.state`));
        // The same decode evaluating again, in batches, what follows the prompt's whole batches.
        const whole = p.length - (p.length % batch);
        await dseq.eraseContextTokenRanges([{ start: whole, end: dseq.nextTokenIndex }]);
        await dseq.evaluateWithoutGeneratingNewTokens(held.slice(whole));
        const redone = await state(dseq, path.join(dir, `${name}-${batch}-${k}-r.state`));
        await dctx.dispose();
        // A fresh prefill of the same tokens, in batches of `batch` from 0.
        const fctx = await model.createContext({ contextSize: 512, batchSize: batch, threads: 1, sequences: 1 });
        const fseq = fctx.getSequence();
        await fseq.evaluateWithoutGeneratingNewTokens(held);
        const fresh = await state(fseq, path.join(dir, `${name}-${batch}-${k}-f.state`));
        await fctx.dispose();

        const L = learnLayout(fresh, geometry, nVocab, 512);
        const diff = differingPositions(decoded, fresh, L);
        // What could be reused without changing a number: the prompt's whole batches.
        expect(diff.filter((i) => i < whole)).toEqual([]);
        // Evaluated again in batches from a batch boundary, all of it is the fresh prefill's.
        expect(differingPositions(redone, fresh, L)).toEqual([]);
        const tail = diff.filter((i) => i >= whole && i < p.length).length;
        const answer = diff.filter((i) => i >= p.length).length;
        rows.push(
          `${name} B=${batch} prompt ${p.length} (whole ${whole}) answer ${held.length - p.length}: ` +
            `differ ${tail}/${p.length - whole} prompt-tail, ${answer}/${held.length - p.length} answer`,
        );
      }
      console.log(rows.join('\n'));
    },
    120_000,
  );

  it('a state cut to whole batches is the state of those tokens; context size and threads change no byte', async () => {
    const geometry = kvGeometry(model.fileInfo.metadata) as { embdK: number[]; embdV: number[] };
    const nVocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
    const p = model.tokenize(PROMPTS[name].join(''), false) as Nlc.Token[];
    const evaluate = async (tokens: Nlc.Token[], o: { contextSize: number; threads: number }, k: string) => {
      const ctx = await model.createContext({ ...o, batchSize: 16, sequences: 1 });
      try {
        const seq = ctx.getSequence();
        await seq.evaluateWithoutGeneratingNewTokens(tokens);
        return await state(seq, path.join(dir, `${name}-cut-${k}.state`));
      } finally {
        await ctx.dispose();
      }
    };
    const all = await evaluate(p, { contextSize: 512, threads: 1 }, 'all');
    const L = learnLayout(all, geometry, nVocab, 512);
    for (const keep of [16, 64, p.length - (p.length % 16)]) {
      const cut = truncateSeqState(all, L, keep);
      expect(cut.equals(await evaluate(p.slice(0, keep), { contextSize: 512, threads: 1 }, `${keep}`))).toBe(true);
    }
    // A prefill reads a decode's state made in a context of another size, or with other threads.
    for (const o of [
      { contextSize: 2048, threads: 1 },
      { contextSize: 512, threads: 2 },
    ])
      expect((await evaluate(p, o, `${o.contextSize}-${o.threads}`)).equals(all)).toBe(true);
    expect(() => truncateSeqState(all, L, p.length + 1)).toThrow(RangeError);
  }, 120_000);
});
