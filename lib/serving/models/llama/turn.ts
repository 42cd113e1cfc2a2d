// Multi-turn KV of a GGUF. A held turn is one sequence state, read whole:
//   prefill  loads the first whole batches of a previous turn's state that
//            its prompt starts with, and evaluates the rest from a batch
//            boundary, which changes no number (prefix.ts); (startTurn)
//   decode   after answering, holds the KV the next turn's prompt starts
//            with, evaluated again from the last batch boundary that is a
//            fresh evaluation's. (keepTurn)
import type * as Nlc from 'node-llama-cpp';
import { type GenerationRequest, KvRejected, type PrefilledKv, type PreviousTurn, type TurnKvState } from '../types';
import { exactOf, sequenceOf } from './contexts';
import { openState, sealState, type OpenedState } from './envelope';
import type { LoadedLlama } from './model';
import { reusableTokens } from './prefix';
import { nextPromptOf } from './prompt';
import { type LlamaStateLayout, truncateSeqState } from './seq-state';

/** The context a prefill evaluates in, the tokens of it that are exact, and what it took of a previous turn. */
export interface TurnStart {
  ctx: Nlc.LlamaContext;
  exact: number;
  turn?: PrefilledKv['turn'];
}

/** A previous turn's state cut to what a prompt may take of it, or why nothing. */
interface Prior {
  state?: Buffer;
  tokens: number;
  skipped?: string;
}

/**
 * A context for a prefill of `prompt`: one that caches what it can of it,
 * with the first tokens of `previous` (when given) loaded into it unless it
 * caches as much already; a context llama.cpp refused the state in is
 * thrown away for a fresh one.
 */
export async function startTurn(
  m: LoadedLlama,
  prompt: Nlc.Token[] | undefined,
  previous: PreviousTurn | undefined,
  signal: AbortSignal,
): Promise<TurnStart> {
  const prior = previous ? previousTurn(m, previous, prompt) : undefined;
  const ctx = await m.pool.acquire(signal, prompt);
  const exact = m.reusable(exactOf(ctx));
  if (!prior?.state) return { ctx, exact, ...(prior ? { turn: { reused: 0, skipped: prior.skipped } } : {}) };
  const seq = sequenceOf(ctx);
  const skip = (skipped: string, at: Nlc.LlamaContext, tokens: number) => ({
    ctx: at,
    exact: tokens,
    turn: { reused: 0, skipped },
  });
  if (reusableTokens(seq.contextTokens, exact, prompt!, ctx.batchSize) >= prior.tokens)
    return skip('cached', ctx, exact);
  try {
    if (seq.nextTokenIndex > 0) await seq.clearHistory();
    await m.files.load(seq, prior.state);
    return { ctx, exact: prior.tokens, turn: { reused: 0 } };
  } catch {
    await m.pool.discard(ctx);
    const fresh = await m.pool.acquire(signal, prompt);
    return skip('refused', fresh, m.reusable(exactOf(fresh)));
  }
}

/**
 * What a prefill may load of a previous turn's state (read whole into the
 * prefill's blocks): the envelope checked as a decode checks it (bound to
 * the hold the params name), the state parsed, evaluated in batches of this
 * context's size, and its tokens the prompt's first ones; cut to the
 * whole batches the two share, leaving the prompt's last token to compute.
 */
function previousTurn(m: LoadedLlama, previous: PreviousTurn, prompt: readonly Nlc.Token[] | undefined): Prior {
  const none = (skipped: string) => ({ tokens: 0, skipped });
  if (!prompt) return none('mismatch');
  let opened: OpenedState;
  try {
    opened = openState(m, previous);
  } catch (e) {
    if (e instanceof KvRejected) return none(`rejected:${e.reason}`);
    throw e;
  }
  try {
    const B = m.batch;
    if (opened.batch !== B) return none('batch-size');
    const held = opened.tokens;
    let same = 0;
    const limit = Math.min(held.length, prompt.length - 1, previous.tokens);
    while (same < limit && held[same] === prompt[same]) same++;
    const tokens = same - (same % B);
    if (tokens === 0) return none('mismatch');
    // A copy: the opened state's buffer goes back below.
    return { state: truncateSeqState(opened.state, m.layout as LlamaStateLayout, tokens), tokens };
  } finally {
    m.buffers.give(opened.state);
  }
}

/**
 * The KV a next turn may read, made on the decode's context after it
 * answered `text`: the tokens the next prompt will start with (the history
 * rendered with this answer, as far as it renders to the tokens the
 * context holds), cut to whole batches, and evaluated again from the last
 * batch boundary that is a fresh evaluation's (`exactPrompt` tokens are), in
 * batches from there, so that every number is what a fresh prefill of them
 * computes (test/serving/llama-turn-kv.test.ts). Undefined: nothing to hold.
 */
export async function keepTurn(
  m: LoadedLlama,
  seq: Nlc.LlamaContextSequence,
  req: GenerationRequest,
  answered: { text: string; exactPrompt: number },
): Promise<{ turn?: TurnKvState; exact: number }> {
  const B = seq.context.batchSize;
  const context = [...seq.contextTokens];
  const next = req.promptTokens ? context : nextPromptOf(m, req, answered.text);
  let same = 0;
  while (next && same < Math.min(context.length, next.length) && context[same] === next[same]) same++;
  const tokens = same - (same % B);
  if (tokens === 0) return { exact: 0 };
  const from = Math.min(answered.exactPrompt - (answered.exactPrompt % B), tokens);
  await seq.eraseContextTokenRanges([{ start: from, end: seq.nextTokenIndex }]);
  if (from < tokens) await seq.evaluateWithoutGeneratingNewTokens(context.slice(from, tokens));
  const state = await m.files.save(seq);
  const info = { promptTokens: tokens, seed: 0, samplingKey: 0, batch: B, fingerprint: m.fingerprint };
  return { exact: tokens, turn: { tokens: context.slice(0, tokens), ...sealState(m, state, info) } };
}

/**
 * Leading tokens of a decode's sequence that still hold its prefill's
 * numbers, evaluated in whole batches from 0 (a held turn evaluates again
 * only what follows their last whole batch): none when the prefill evaluated
 * in batches of another size; without the continuation the class evaluated
 * the prompt's last token again; and the prompt must be what was loaded.
 */
export function exactPrompt(
  loaded: { batch?: number; tokens: readonly number[] },
  seq: Nlc.LlamaContextSequence,
  continued: boolean,
): number {
  if (loaded.batch !== seq.context.batchSize) return 0;
  const n = continued ? loaded.tokens.length : loaded.tokens.length - 1;
  const now = seq.contextTokens;
  for (let i = 0; i < n; i++) if (now[i] !== loaded.tokens[i]) return 0;
  return Math.max(0, n);
}
