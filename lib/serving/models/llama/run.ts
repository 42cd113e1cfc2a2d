// Generation through node-llama-cpp's own classes, as a one-process user
// would run them: LlamaChatSession for a chat, LlamaCompletion for a
// completion. The prefill and the decode run the same classes on views of
// the sequence (continue.ts, prefix.ts), so every number and every rule
// (held-back pieces, stop strings, max_tokens) is the class's.
import type * as Nlc from 'node-llama-cpp';
import type { Generated, GenerationRequest, TextSink } from '../types';
import { exactOf, sequenceOf } from './contexts';
import type { LoadedLlama } from './model';
import { reusing } from './prefix';
import { chatHistory, promptOf } from './prompt';
import { WholeText } from './text';

/** A generation's result, with its text (a held turn renders the next prompt from it). */
export type Run = Omit<Generated, 'info'> & { text: string };

/** The options both classes take, and the tokens they generate. */
interface ClassOptions {
  maxTokens: number;
  temperature: number;
  topP?: number;
  seed?: number;
  customStopTriggers?: string[];
  signal: AbortSignal;
  onToken: (t: Nlc.Token[]) => void;
}

/** What a class answered: its final text, why it stopped, and the prompt's tokens. */
interface ClassAnswer {
  final: string;
  stopReason: string;
  promptTokens: number;
}

/** Tokens the sequence evaluated so far (the prompt's and the generated ones). */
export function evaluated(seq: Nlc.LlamaContextSequence): number {
  return seq.tokenMeter.usedInputTokens + seq.tokenMeter.usedOutputTokens;
}

/**
 * Generates on `seq` with node-llama-cpp's own classes, sampling as `req`
 * says (its seed is the one to use); a prompt that cannot fit the context
 * with max_tokens (and a prefill's decodeMaxTokens) is a 400.
 */
export async function run(
  m: LoadedLlama,
  seq: Nlc.LlamaContextSequence,
  req: GenerationRequest,
  to: { signal: AbortSignal; out?: TextSink },
): Promise<Run> {
  const tokens: Nlc.Token[] = [];
  const text = new WholeText(m.model, to.out);
  const options: ClassOptions = {
    maxTokens: req.maxTokens,
    temperature: req.temperature,
    ...(req.topP !== undefined ? { topP: req.topP } : {}),
    ...(req.seed !== undefined ? { seed: req.seed } : {}),
    ...(req.stop.length ? { customStopTriggers: req.stop } : {}),
    signal: to.signal,
    onToken: (t: Nlc.Token[]) => {
      tokens.push(...t);
      text.add(t);
    },
  };
  const a = req.chat ? await runChat(m, seq, req, options) : await runCompletion(m, seq, req, options);
  text.end(a.final);
  return {
    text: a.final,
    promptTokens: a.promptTokens,
    completionTokens: tokens.length,
    finishReason: a.stopReason === 'maxTokens' ? 'length' : 'stop',
  };
}

async function runChat(
  m: LoadedLlama,
  seq: Nlc.LlamaContextSequence,
  req: GenerationRequest,
  options: ClassOptions,
): Promise<ClassAnswer> {
  const { history, last } = chatHistory(req.messages, m.id);
  const session = new m.nlc.LlamaChatSession({ contextSequence: seq, autoDisposeSequence: false });
  try {
    const context = session.chatWrapper.generateContextState({
      chatHistory: [...history, { type: 'user', text: last }, { type: 'model', response: [] }],
    }).contextText;
    const promptTokens = context.tokenize(m.model.tokenizer).length;
    m.fits(promptTokens, Math.max(req.maxTokens, req.decodeMaxTokens ?? 0));
    session.setChatHistory(history);
    const { stopReason, responseText: final } = await session.promptWithMeta(last, options);
    return { final, stopReason, promptTokens };
  } finally {
    session.dispose({ disposeSequence: false });
  }
}

async function runCompletion(
  m: LoadedLlama,
  seq: Nlc.LlamaContextSequence,
  req: GenerationRequest,
  options: ClassOptions,
): Promise<ClassAnswer> {
  // What LlamaCompletion evaluates: BOS when the vocabulary prepends one,
  // then the prompt without the tokenizer's leading space (or the ids as given).
  const bos = m.model.tokens.shouldPrependBosToken && m.model.tokens.bos !== null;
  const input = req.promptTokens ? (req.promptTokens as Nlc.Token[]) : req.prompt;
  const promptTokens =
    (req.promptTokens ?? m.model.tokenize(req.prompt, false, bos ? 'trimLeadingSpace' : undefined)).length +
    (bos ? 1 : 0);
  m.fits(promptTokens, Math.max(req.maxTokens, req.decodeMaxTokens ?? 0));
  const completion = new m.nlc.LlamaCompletion({ contextSequence: seq });
  try {
    const { response: final, metadata } = await completion.generateCompletionWithMeta(input, options);
    return { final, stopReason: metadata.stopReason, promptTokens };
  } finally {
    completion.dispose({ disposeSequence: false });
  }
}

/** Evaluates and generates here (an aggregated worker), reusing what its context caches of the prompt. */
export async function generate(
  m: LoadedLlama,
  req: GenerationRequest,
  out: TextSink,
  signal: AbortSignal,
): Promise<Generated> {
  const ctx = await m.pool.acquire(signal, promptOf(m, req));
  const seq = sequenceOf(ctx);
  const reuse = reusing(seq, m.reusable(exactOf(ctx)));
  const before = evaluated(seq);
  let keep = 0;
  try {
    const r = await run(m, reuse.sequence, req, { signal, out });
    keep = m.reusable(reuse.exactAfter());
    return {
      completionTokens: r.completionTokens,
      finishReason: r.finishReason,
      promptTokens: r.promptTokens,
      info: { prefix_reused_tokens: reuse.reused(), tokens_evaluated: evaluated(seq) - before },
    };
  } finally {
    await m.pool.release(ctx, keep);
  }
}
