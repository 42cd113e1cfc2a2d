// Turn 2 of a conversation on GGUF workers (node-llama-cpp, the generated
// 'small' model), through the proxy: time to first token when its prefill
// loads turn 1's state from the decode that answered it (bidirectional KV,
// conversation_id) and evaluates only what follows its whole batches,
// against the same turn recomputed (no conversation), for growing
// histories. Both prefills run without their own prefix cache, so that
// "recompute" evaluates the whole prompt. The two alternate request by
// request; the section fails if they answer differently. Also: what holding
// a turn costs the decode after it answered (its answer's turn_kv_ms).
import { modelPath } from '../lib/serving/models/test-models';
import { conversationCluster, firstToken, turnTimes } from './multiturn';
import { median } from './stats';

export interface GgufMultiturnRow {
  /** Prompt tokens of turn 2 (the model's tokens are bytes, with BOS). */
  promptTokens: number;
  reusedTokens: number;
  reuseMs: number;
  reuseMin: number;
  reuseMax: number;
  recomputeMs: number;
  recomputeMin: number;
  recomputeMax: number;
  /** reuse / recompute (medians), and its range over the pairs (each reuse over the recompute beside it). */
  ratio: number;
  ratioMin: number;
  ratioMax: number;
  /** The decode's time to hold turn 1 once it answered (evaluating again in batches, saving), median ms. */
  holdMs: number;
}

const WORDS = ['tell', 'me', 'about', 'the', 'river', 'and', 'its', 'many', 'boats', 'under', 'a', 'grey', 'sky'];

/** `n` turn-2 requests each way per history size (bytes of turn 1's prompt; the model takes about 1.4 tokens a byte). */
export async function benchMultiturnGguf(
  n: number,
  sizes: readonly number[],
  batchSize = 512,
): Promise<GgufMultiturnRow[]> {
  const model = modelPath('small');
  const proxy = await conversationCluster('bench-mtg', {
    model,
    contextSize: 4096,
    batchSize,
    parallel: 1,
    prefixCache: false,
    blockBytes: 256 << 10,
  });
  const rows: GgufMultiturnRow[] = [];
  try {
    let conv = 0;
    for (const size of sizes) {
      const reuse: number[] = [];
      const recompute: number[] = [];
      const ratios: number[] = [];
      const hold: number[] = [];
      let reused = 0;
      let prompt = 0;
      for (let i = 0; i < n + 1; i++) {
        const id = `bench-gguf-${++conv}`;
        const words: string[] = [`${i}`];
        for (let w = 0; words.join(' ').length < size; w++) words.push(WORDS[(w * 7 + i) % WORDS.length]);
        const history = `user: ${words.join(' ')}`.slice(0, size);
        // Greedy: the two answers must be the same text.
        const ask = { temperature: 0 };
        const t1 = await firstToken(proxy.url, { ...ask, prompt: history, max_tokens: 32, conversation_id: id });
        const turn2 = `${history}${t1.text}\nuser: and then?\n`;
        const a = await firstToken(proxy.url, { ...ask, prompt: turn2, max_tokens: 8, conversation_id: id });
        const b = await firstToken(proxy.url, { ...ask, prompt: turn2, max_tokens: 8 });
        if (a.text !== b.text) throw new Error(`turn 2 answered differently with reuse (history ${size})`);
        if (a.reused === 0) throw new Error(`turn 2 reused nothing (history ${size}): ${JSON.stringify(a.info)}`);
        if (i === 0) continue; // warm-up: handshakes, contexts
        reuse.push(a.ms);
        recompute.push(b.ms);
        ratios.push(a.ms / b.ms);
        hold.push(Number(t1.info.turn_kv_ms ?? Number.NaN));
        reused = a.reused;
        prompt = Number(b.info.kv_tokens_loaded ?? 0) || turn2.length + 1;
      }
      rows.push({
        promptTokens: prompt,
        reusedTokens: reused,
        ...turnTimes(reuse, recompute),
        ratioMin: Math.min(...ratios),
        ratioMax: Math.max(...ratios),
        holdMs: median(hold),
      });
    }
  } finally {
    await proxy.close();
  }
  return rows;
}
