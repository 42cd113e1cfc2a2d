// Prefill and decode of a GGUF, through its KV in blocks.
//   prefill  runs node-llama-cpp's own LlamaCompletion (or LlamaChatSession,
//            through the model's chat template) until the sequence has
//            sampled its first token, saves the sequence state (exactly the
//            prompt) and seals it with that token (envelope.ts) for the
//            request's blocks;
//   decode   opens the envelope (model, build, size, checksum or HMAC, the
//            request it was made for) and parses the state for this model
//            and context before llama.cpp sees a byte, loads it into a fresh
//            sequence (a context a failed load touched is thrown away, never
//            reused) and runs the same class again on a view that continues
//            from the first token (continue.ts).
import { randomInt } from 'node:crypto';
import type * as Nlc from 'node-llama-cpp';
import {
  type Generated,
  type GenerationRequest,
  type KvInput,
  KvRejected,
  ModelRequestError,
  type PrefilledKv,
  type PreviousTurn,
  type TextSink,
  type TurnKvState,
} from '../types';
import { sequenceOf } from './contexts';
import { FirstTokenSampled, continueFrom, firstTokenOf } from './continue';
import { type OpenedState, openState, sealState } from './envelope';
import type { LoadedLlama } from './model';
import { reusing } from './prefix';
import { chatHistory, promptOf, pushPromptOf, samplingKey } from './prompt';
import { pushSize, unpushable } from './push';
import { evaluated, run } from './run';
import { type TurnStart, exactPrompt, keepTurn, startTurn } from './turn';

/** What a prefill's evaluation left: the state, its tokens, the first token sampled, and what was reused. */
interface Evaluation {
  state: Buffer;
  saved: number[];
  nextToken?: number;
  saveMs: number;
  exactTokens: number;
  reused: number;
  tokensEvaluated: number;
}

/** Evaluates the prompt (from a previous turn's KV when given) and returns its KV, sealed for the request's blocks. */
export async function prefill(
  m: LoadedLlama,
  req: GenerationRequest,
  signal: AbortSignal,
  previous?: PreviousTurn,
): Promise<PrefilledKv> {
  const start = await startTurn(m, promptOf(m, req), previous, signal);
  // Unseeded sampling: one seed for the whole request, the decode's sampler goes on with it.
  const seed = req.temperature > 0 ? (req.seed ?? randomInt(2 ** 32)) : req.seed;
  const e = await evaluate(m, start, { ...req, seed }, signal);
  const promptTokens = e.saved.length;
  const B = start.ctx.batchSize;
  const info = {
    promptTokens,
    nextToken: e.nextToken,
    seed: seed ?? 0,
    samplingKey: samplingKey(req),
    fingerprint: m.fingerprint,
    // Its whole batches are a fresh evaluation's (what a decode may keep of them for a next turn).
    batch: e.exactTokens === promptTokens - (promptTokens % B) ? B : 0,
  };
  // Tokens taken from the previous turn's state, or else from the context's own cache.
  const turn = start.turn && start.turn.skipped === undefined ? { reused: e.reused } : start.turn;
  return {
    ...sealState(m, e.state, info),
    promptTokens,
    saveMs: e.saveMs,
    ...(turn ? { turn } : {}),
    info: {
      prefix_reused_tokens: turn?.skipped === undefined && turn ? 0 : e.reused,
      tokens_evaluated: e.tokensEvaluated,
    },
    whole: true,
    unpushable: unpushable(m.layout, pushPromptOf(m, req), e.saved, e.state.length),
  };
}

/**
 * The prompt evaluated exactly as a generation evaluates it, by the
 * generation's own class, up to its first sampled token; then the state saved.
 */
async function evaluate(
  m: LoadedLlama,
  start: TurnStart,
  req: GenerationRequest,
  signal: AbortSignal,
): Promise<Evaluation> {
  const seq = sequenceOf(start.ctx);
  const r = reusing(seq, start.exact);
  const before = evaluated(seq);
  let keep = 0;
  try {
    let nextToken: number | undefined;
    try {
      await run(m, firstTokenOf(r.sequence), req, { signal });
    } catch (e) {
      if (!(e instanceof FirstTokenSampled)) throw e;
      nextToken = e.token;
    }
    const saved = [...seq.contextTokens];
    const t0 = performance.now();
    const state = await m.files.save(seq); // lent: sealState's writeTo gives it back
    const saveMs = performance.now() - t0;
    const exactTokens = r.exactAfter();
    keep = m.reusable(exactTokens);
    return {
      state,
      saved,
      nextToken,
      saveMs,
      exactTokens,
      reused: r.reused(),
      tokensEvaluated: evaluated(seq) - before,
    };
  } finally {
    await m.pool.release(start.ctx, keep);
  }
}

/**
 * Generates from the state in the blocks: opened and checked first (nothing
 * loaded from blocks that do not hold this prompt's state for this model and
 * request), then loaded into a cleared context, which is thrown away, never
 * reused, when anything goes wrong once llama.cpp has the state.
 */
export async function decode(
  m: LoadedLlama,
  req: GenerationRequest,
  kv: KvInput,
  out: TextSink,
  signal: AbortSignal,
): Promise<Generated> {
  const t0 = performance.now();
  // The state is lent by m.buffers (given back once llama.cpp has it); `env` is the rest.
  const { state, ...env } = openState(m, kv, req);
  kv.blocksRead?.(); // the state is a copy now
  let ctx: Nlc.LlamaContext;
  try {
    // Every path below (the greedy ones too) fits the context, or nothing is loaded.
    m.fits(env.promptTokens, req.maxTokens);
    ctx = await m.pool.acquire(signal);
  } catch (e) {
    m.buffers.give(state);
    throw e;
  }
  let after: { clean: boolean; keep: number } = { clean: false, keep: 0 };
  try {
    const seq = sequenceOf(ctx);
    try {
      if (seq.nextTokenIndex > 0) await seq.clearHistory(); // a prompt kept for reuse
      await m.files.load(seq, state);
    } finally {
      m.buffers.give(state); // llama.cpp has its own copy now (or refused it)
    }
    const loadMs = performance.now() - t0;
    const d = await generateLoaded(m, { seq, env, stateBytes: state.length, loadMs, req, out, signal });
    after = d;
    return d.generated;
  } catch (e) {
    // A request's own 4xx (or its client gone) leaves a state llama.cpp made: clearing it is enough.
    if (e instanceof ModelRequestError || signal.aborted) after.clean = true;
    throw e;
  } finally {
    await (after.clean ? m.pool.release(ctx, m.reusable(after.keep)) : m.pool.discard(ctx));
  }
}

/** A decode with its state loaded into `seq`. */
interface Loaded {
  seq: Nlc.LlamaContextSequence;
  /** The opened state's fields and tokens (its bytes' buffer is given back). */
  env: Omit<OpenedState, 'state'>;
  stateBytes: number;
  loadMs: number;
  req: GenerationRequest;
  out: TextSink;
  signal: AbortSignal;
}

/**
 * Generates on a loaded state, continuing from the prefill's next token
 * where this request samples as the prefill's did, then holds the turn
 * when asked: its answer, whether the context may be reused, and the tokens
 * of it a later prompt may reuse.
 */
async function generateLoaded(
  m: LoadedLlama,
  { seq, env, stateBytes, loadMs, req, out, signal }: Loaded,
): Promise<{ generated: Generated; clean: boolean; keep: number }> {
  const loaded = seq.contextTokens.length;
  const before = evaluated(seq);
  const go =
    env.nextToken !== undefined && env.samplingKey === samplingKey(req)
      ? continueFrom(seq, { next: env.nextToken as Nlc.Token, sampled: req.temperature > 0 })
      : undefined;
  const seed = req.temperature > 0 ? (req.seed ?? env.seed) : req.seed;
  const r = await run(m, go?.sequence ?? seq, { ...req, seed }, { signal, out });
  const evaluatedHere = evaluated(seq) - before;
  let turn: TurnKvState | undefined;
  let turnMs: number | undefined;
  let clean = true;
  let keep = 0;
  if (req.keepTurn && !signal.aborted) {
    const t1 = performance.now();
    try {
      const kept = await keepTurn(m, seq, req, {
        text: r.text,
        exactPrompt: exactPrompt(env, seq, go?.used() ?? false),
      });
      turn = kept.turn;
      keep = kept.exact;
      turnMs = performance.now() - t1;
    } catch {
      // The answer stands; the next turn recomputes, and this context is not reused.
      clean = false;
    }
  }
  const generated: Generated = {
    completionTokens: r.completionTokens,
    finishReason: r.finishReason,
    promptTokens: env.promptTokens,
    ...(turn ? { turn } : {}),
    info: {
      kv_state_bytes: stateBytes,
      kv_tokens_loaded: loaded,
      kv_continued: go?.used() ?? false,
      tokens_evaluated: evaluatedHere,
      kv_load_ms: round(loadMs),
      // Holding the turn for the next one: evaluating again in whole batches, saving.
      ...(turnMs !== undefined ? { turn_kv_ms: round(turnMs), turn_kv_tokens: turn?.tokens.length ?? 0 } : {}),
    },
  };
  return { generated, clean, keep };
}

/** Push decode: the blocks of the state a prefill saves for this prompt, computed from its tokens (push.ts). */
export function pushBlocksFor(m: LoadedLlama, req: GenerationRequest): number {
  if (typeof m.layout === 'string')
    throw new KvRejected(`this decode cannot check KV states of ${m.id}: ${m.layout}`, 'unsupported');
  const tokens = promptOf(m, req);
  if (!tokens) {
    chatHistory(req.messages, m.id); // a chat that is not valid: its 400, as the prefill answers
    throw new ModelRequestError(400, 'the messages give no prompt');
  }
  m.fits(tokens.length, req.maxTokens);
  const pushed = pushPromptOf(m, req)!;
  if (typeof pushed === 'string') throw new ModelRequestError(400, pushed);
  return pushSize(m.layout, pushed.length, m.o.blockBytes).blocks;
}

function round(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}
