// truncateSeqState against llama.cpp itself, in both V layouts (flash
// attention: V by rows; without: V transposed) and both test model shapes:
// the first k tokens of a saved state are byte for byte the state llama.cpp
// saves for a sequence that evaluated only those k tokens, in the same
// batches (k a multiple of the batch size).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { kvGeometry, learnLayout, truncateSeqState } from '../../lib/serving/models/llama/seq-state';
import { loadNodeLlamaCpp } from '../../lib/serving/models/node-llama-cpp';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-truncate-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));
const CTX = 256;
const B = 16;

it.each(['tiny', 'tiny-utf8', 'small'])(
  '%s: a cut state is what llama.cpp saves for the first k tokens, both V layouts',
  async (name) => {
    const nlc = await loadNodeLlamaCpp();
    const llama = await nlc.getLlama({ gpu: false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    const model = await llama.loadModel({ modelPath: modelPath(name, dir) });
    const nVocab = (model.fileInfo.metadata as { tokenizer: { ggml: { tokens: unknown[] } } }).tokenizer.ggml.tokens
      .length;
    const layouts = new Set<boolean>();
    try {
      for (const flashAttention of [false, true]) {
        const ctx = await model.createContext({ contextSize: CTX, threads: 1, batchSize: B, flashAttention });
        const save = async (tokens: readonly number[]) => {
          const seq = ctx.getSequence();
          await seq.evaluateWithoutGeneratingNewTokens(tokens as never);
          const file = path.join(dir, `${name}-${flashAttention}-${tokens.length}.state`);
          await seq.saveStateToFile(file);
          seq.dispose();
          return fs.readFileSync(file);
        };
        const tokens = model
          .tokenize('Привет, the rivers and hills of 你好 under a quiet rain. '.repeat(3))
          .slice(0, 70);
        expect(tokens.length).toBe(70);
        const whole = await save(tokens);
        const l = learnLayout(whole, kvGeometry(model.fileInfo.metadata)!, nVocab, CTX);
        layouts.add(l.vTrans);
        for (const k of [B, 2 * B, 4 * B]) {
          const cut = truncateSeqState(whole, l, k);
          expect(cut.equals(await save(tokens.slice(0, k))), `flash ${flashAttention}, k ${k}`).toBe(true);
        }
        await ctx.dispose();
      }
    } finally {
      await model.dispose();
    }
    expect([...layouts].sort()).toEqual([false, true]);
  },
  120_000,
);
