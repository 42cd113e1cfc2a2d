// A request's prompt as node-llama-cpp's classes render and tokenize it:
// LlamaCompletion (BOS, then the prompt without the tokenizer's leading
// space, or the ids as given) or LlamaChat (the chat template's context).
// The prefill, the decode, a push decode sizing its blocks and a decode
// holding a turn for the next one all need the same tokens, so they are
// computed here only.
import { createHash } from 'node:crypto';
import type * as Nlc from 'node-llama-cpp';
import { type ChatMessage, type GenerationRequest, ModelRequestError, type ModelTokenizer } from '../types';
import { type LoadedLlama, vocabSize } from './model';
import { evaluatedPrompt } from './push';

/** The GGUF's vocabulary (generate endpoint: token ids in and out), or undefined when its metadata lists none. */
export function tokenizerOf(m: LoadedLlama): ModelTokenizer | undefined {
  const model = m.model;
  const size = vocabSize(model);
  if (!size) return undefined;
  const bos = model.tokens.shouldPrependBosToken ? model.tokens.bos : null;
  return {
    vocabSize: size,
    ...(bos !== null ? { bos } : {}),
    contextTokens: m.contextSize,
    encode: (text) => model.tokenize(text, false, 'trimLeadingSpace') as number[],
    decode: (ids) => model.detokenize((ids[0] === bos ? ids.slice(1) : ids) as Nlc.Token[], false),
  };
}

/** What a prompt's tokens depend on: the vocabulary and the chat template (a whole LoadedLlama, or the vocabulary alone: vocab.ts). */
export interface PromptModel {
  readonly id: string;
  readonly model: Nlc.LlamaModel;
  readonly chatWrapper: Nlc.ChatWrapper;
  /**
   * Prompt bytes above which the prompt certainly has more tokens than a
   * context holds: its tokens times the longest vocabulary piece, which no
   * token covers more bytes than.
   */
  readonly maxPromptBytes?: number;
}

/**
 * The tokens a request's prompt evaluates as, as the class computes them; a
 * chat whose messages are not valid gives none (run.ts answers the 400).
 */
export function promptOf(m: PromptModel, req: GenerationRequest): Nlc.Token[] | undefined {
  refuseUntokenized(m, req);
  return promptOfAnyLength(m, req);
}

/** promptOf, however long the prompt (POST /tokenize: vLLM answers the ids and max_model_len of any prompt). */
export function promptOfAnyLength(m: PromptModel, req: GenerationRequest): Nlc.Token[] | undefined {
  if (req.chat) return chatTokens(m, req, [{ type: 'model', response: [] }]);
  const model = m.model;
  const bos = model.tokens.shouldPrependBosToken ? model.tokens.bos : null;
  const tokens = req.promptTokens
    ? (req.promptTokens as Nlc.Token[])
    : model.tokenize(req.prompt, false, bos !== null ? 'trimLeadingSpace' : undefined);
  return bos !== null ? [bos, ...tokens] : tokens;
}

/**
 * A 400 for a prompt longer in bytes than any context holds tokens, before
 * tokenizing it: llama.cpp's tokenizer is synchronous, on the event loop, and
 * its cost grows faster than the prompt (the test models' vocabulary: 1.2 s
 * for 100 KB, about 100 s for 1 MB) for a prompt refused anyway.
 */
function refuseUntokenized(m: PromptModel, req: GenerationRequest): void {
  const limit = m.maxPromptBytes;
  if (limit === undefined || req.promptTokens) return;
  let bytes = 0;
  if (!req.chat) bytes = Buffer.byteLength(req.prompt);
  else
    for (const msg of req.messages ?? []) {
      const c = (msg as { content?: unknown } | null)?.content;
      if (typeof c === 'string') bytes += Buffer.byteLength(c);
      else if (Array.isArray(c))
        for (const p of c) {
          const t = (p as { text?: unknown } | null)?.text;
          if (typeof t === 'string') bytes += Buffer.byteLength(t);
        }
    }
  if (bytes > limit)
    throw new ModelRequestError(
      400,
      `a prompt of ${bytes} bytes has more tokens than this model's context holds (more than ${limit} bytes always do)`,
    );
}

/** The tokens of the next turn's prompt, as far as they follow from this request and its answer. */
export function nextPromptOf(m: LoadedLlama, req: GenerationRequest, text: string): Nlc.Token[] | undefined {
  if (!req.chat) return promptOf(m, { ...req, prompt: req.prompt + text });
  // A user message after the answer: how the template closes the answer.
  return chatTokens(m, req, [
    { type: 'model', response: [text] },
    { type: 'user', text: '.' },
    { type: 'model', response: [] },
  ]);
}

/** A chat's tokens as its template renders them: the messages, then `after` (undefined: messages not valid). */
function chatTokens(m: PromptModel, req: GenerationRequest, after: Nlc.ChatHistoryItem[]): Nlc.Token[] | undefined {
  let h: ReturnType<typeof chatHistory>;
  try {
    h = chatHistory(req.messages, m.id);
  } catch {
    return undefined;
  }
  return m.chatWrapper
    .generateContextState({ chatHistory: [...h.history, { type: 'user', text: h.last }, ...after] })
    .contextText.tokenize(m.model.tokenizer);
}

/** Push: the tokens node-llama-cpp evaluates of a request's prompt (push.ts), or why they cannot be known. */
export function pushPromptOf(m: LoadedLlama, req: GenerationRequest): readonly number[] | string | undefined {
  if (typeof m.layout === 'string') return m.layout;
  const tokens = promptOf(m, req);
  const bos = !req.chat && m.model.tokens.shouldPrependBosToken && m.model.tokens.bos !== null;
  // The context's own size (nCtx: what llama.cpp made of contextSize), as the classes read it.
  return tokens && evaluatedPrompt(tokens, { chat: req.chat, contextSize: m.layout.nCtx, bos });
}

/**
 * What chooses a first token: a decode asked to sample otherwise than its
 * prefill (another temperature, top_p or seed) does not take the prefill's
 * next token. 32 bits of a sha256: a check between honest peers.
 */
export function samplingKey(req: Pick<GenerationRequest, 'temperature' | 'topP' | 'seed'>): number {
  const settings = JSON.stringify([req.temperature, req.topP ?? null, req.seed ?? null]);
  return createHash('sha256').update(settings).digest().readUInt32LE(0);
}

/** OpenAI messages as node-llama-cpp's chat history, and the last user message (what is prompted). */
export function chatHistory(messages: ChatMessage[], model: string): { history: Nlc.ChatHistoryItem[]; last: string } {
  const text = (m: ChatMessage, i: number): string => {
    if (typeof m.content === 'string') return m.content;
    return m.content
      .map((p, j) => {
        if (p.type !== 'text')
          throw new ModelRequestError(400, `messages[${i}].content[${j}]: ${model} takes text only`);
        return p.text ?? '';
      })
      .join('\n');
  };
  const history: Nlc.ChatHistoryItem[] = messages.map((m, i) => {
    const t = text(m, i);
    switch (m.role) {
      case 'system':
      case 'developer':
        return { type: 'system', text: t };
      case 'user':
        return { type: 'user', text: t };
      case 'assistant':
        return { type: 'model', response: [t] };
      default:
        throw new ModelRequestError(400, `messages[${i}].role '${m.role}': use system, user or assistant`);
    }
  });
  const last = history.pop();
  if (last?.type !== 'user') throw new ModelRequestError(400, 'the last message must be the user’s');
  return { history, last: last.text };
}
