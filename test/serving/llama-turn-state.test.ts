// The KV a GGUF decode holds for a next turn, and what a prefill makes of
// it, on the model itself: a prefill that starts from a held turn's state
// makes a state byte for byte that of a fresh prefill of the same prompt;
// a held state that is damaged, bound to another hold, evaluated in other
// batches or of another prompt is not loaded, and the prompt is evaluated
// whole (the same bytes again).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LlamaModel } from '../../lib/serving/models/llama';
import { modelPath } from '../../lib/serving/models/test-models';
import type { BlockView, GenerationRequest, KvBinding, PreviousTurn } from '../../lib/serving/models/types';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-turn-state-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));
const BLOCK = 64 << 10;
const SECRET = 's3cret';

function blocks(n = 64): { view: BlockView; bufs: Buffer[] } {
  const bufs = Array.from({ length: n }, () => Buffer.alloc(BLOCK));
  return { view: (b) => bufs[b], bufs };
}

const load = (name: string, o: { batchSize?: number; prefixCache?: boolean } = {}) =>
  LlamaModel.load({
    modelPath: modelPath(name, dir),
    contextSize: 1024,
    threads: 1,
    batchSize: o.batchSize ?? 16,
    parallel: 1,
    prefixCache: o.prefixCache,
    blockBytes: BLOCK,
    poolBytes: 64 * BLOCK,
    kvSecret: SECRET,
  });

const ask = (prompt: string, maxTokens: number): GenerationRequest => ({
  chat: false,
  prompt,
  messages: [],
  maxTokens,
  temperature: 0,
  stop: [],
});

describe.each(['tiny', 'tiny-utf8'])('%s: a held turn, as the next prefill reads it', (name) => {
  let m: LlamaModel;
  let fresh: LlamaModel;
  const signal = new AbortController().signal;
  beforeAll(async () => {
    m = await load(name, { prefixCache: false });
    fresh = await load(name, { prefixCache: false });
  }, 120_000);
  afterAll(async () => {
    await m?.close();
    await fresh?.close();
  });

  const binding = (requestId: string, n: number): KvBinding => ({
    engineId: 'e',
    requestId,
    blockIds: Array.from({ length: n }, (_, i) => i),
  });

  /** Turn 1 through prefill and decode; the decode's held turn in blocks of its own. */
  async function turn1(prompt: string) {
    const kv = await m.prefill(ask(prompt, 1), signal);
    const p = blocks();
    kv.writeTo(p.view, binding('p', kv.blocks));
    let text = '';
    const g = await m.decode(
      { ...ask(prompt, 24), keepTurn: true },
      { view: p.view, blocks: kv.blocks, binding: binding('p', kv.blocks) },
      (t) => {
        text += t;
      },
      signal,
    );
    expect(g.turn).toBeDefined();
    const held = blocks();
    const hb = binding('held', g.turn!.blocks);
    g.turn!.writeTo(held.view, hb);
    return { text, turn: g.turn!, held, hb };
  }

  /** The envelope a prefill of `prompt` writes (bound to one request), from `previous` or from nothing. */
  async function prefilled(model: LlamaModel, prompt: string, previous?: PreviousTurn) {
    const kv = await model.prefill(ask(prompt, 1), signal, previous);
    const out = blocks();
    kv.writeTo(out.view, binding('next', kv.blocks));
    return { kv, bytes: Buffer.concat(out.bufs.slice(0, kv.blocks)) };
  }

  const PROMPT =
    name === 'tiny'
      ? 'user: Tell me a story about a dragon and a knight who become friends, « vraiment » 龍.\nassistant:'
      : 'user: Расскажи мне короткую историю о драконе. 你好吗？\nassistant:';

  it('from the held state, the next prompt state is byte for byte a fresh prefill', async () => {
    const t = await turn1(PROMPT);
    const next = `${PROMPT}${t.text}\nuser: and then?\nassistant:`;
    expect(t.turn.tokens.length % 16).toBe(0);
    expect(t.turn.tokens).toEqual(m.promptTokenIds(ask(next, 1)).slice(0, t.turn.tokens.length));
    const prev = { view: t.held.view, blocks: t.turn.blocks, tokens: t.turn.tokens.length, binding: t.hb };
    const reused = await prefilled(m, next, prev);
    expect(reused.kv.turn).toEqual({ reused: t.turn.tokens.length });
    expect(reused.kv.info?.tokens_evaluated).toBe(reused.kv.promptTokens - t.turn.tokens.length);
    const whole = await prefilled(fresh, next);
    expect(reused.bytes.equals(whole.bytes)).toBe(true);
  }, 120_000);

  it('a damaged, rebound, other-batch or other-prompt held state is not loaded; the prompt is evaluated whole', async () => {
    const t = await turn1(PROMPT);
    const next = `${PROMPT}${t.text}\nuser: more\nassistant:`;
    const whole = await prefilled(fresh, next);
    const prev = { view: t.held.view, blocks: t.turn.blocks, tokens: t.turn.tokens.length, binding: t.hb };
    const cases: Array<[string, PreviousTurn, string]> = [];
    // One bit of the state.
    const bad = blocks();
    for (let b = 0; b < t.turn.blocks; b++) t.held.bufs[b].copy(bad.bufs[b]);
    bad.bufs[0][1000] ^= 0x10;
    cases.push(['rejected:unauthenticated', { ...prev, view: bad.view }, next]);
    // Bound to another hold.
    cases.push(['rejected:wrong-request', { ...prev, binding: binding('other', t.turn.blocks) }, next]);
    // Fewer blocks than the state takes.
    cases.push(['rejected:truncated', { ...prev, blocks: 0 }, next]);
    // A prompt that is not the held tokens' continuation.
    cases.push(['mismatch', prev, `X${next.slice(1)}`]);
    for (const [why, previous, prompt] of cases) {
      const r = await prefilled(m, prompt, previous);
      expect(r.kv.turn, why).toEqual({ reused: 0, skipped: why });
      if (prompt === next) expect(r.bytes.equals(whole.bytes), why).toBe(true);
    }
    // A prefill that evaluates in other batches than the held state was.
    const other = await load(name, { batchSize: 32, prefixCache: false });
    try {
      const r = await prefilled(other, next, prev);
      expect(r.kv.turn).toEqual({ reused: 0, skipped: 'batch-size' });
    } finally {
      await other.close();
    }
  }, 120_000);
});
