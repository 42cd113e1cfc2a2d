// vLLM's POST /tokenize and /detokenize on a worker, so that a router that
// routes on KV events (llm-d's precise prefix-cache scorer) can compute the
// block keys of a prompt with this worker's own tokens. /tokenize answers
// the ids the worker evaluates for the prompt, the same ids its BlockStored
// events carry: a completion's with the beginning-of-sequence token the model
// adds (add_special_tokens, default true, as vLLM), a chat's as its template
// renders the messages with the generation prompt.
import { HttpError } from '../api/http';
import type { GenerationRequest, ServingModel } from '../models/types';
import { ModelNotFound } from '../api/openai';

/** What the routes need of the worker. */
export interface TokenizeHandler {
  readonly model: Pick<ServingModel, 'tokenizer' | 'promptTokenIds'>;
  readonly modelId: string;
  readonly servedModelNames?: readonly string[];
  healthInfo(): { max_model_len?: number };
}

function flag(body: Record<string, unknown>, k: string, dflt: boolean): boolean {
  const v = body[k] ?? dflt;
  if (typeof v !== 'boolean') throw new HttpError(400, `'${k}' must be a boolean`);
  return v;
}

function checkModel(w: TokenizeHandler, body: Record<string, unknown>): void {
  const m = body.model;
  if (m === undefined || m === null) return;
  const served = w.servedModelNames ?? [w.modelId];
  if (typeof m !== 'string' || !served.includes(m)) throw new ModelNotFound(String(m).slice(0, 200), served);
}

/** POST /tokenize: {prompt | messages, add_special_tokens?} -> {count, max_model_len, tokens}. */
export function tokenizeBody(w: TokenizeHandler, body: Record<string, unknown>): Record<string, unknown> {
  checkModel(w, body);
  if (!w.model.promptTokenIds) throw new HttpError(501, 'this model cannot tokenize', 'not_implemented');
  const chat = body.messages !== undefined;
  if (chat === (body.prompt !== undefined)) throw new HttpError(400, "give either 'prompt' or 'messages'");
  if (!chat && typeof body.prompt !== 'string') throw new HttpError(400, "'prompt' must be a string");
  if (chat && !Array.isArray(body.messages)) throw new HttpError(400, "'messages' must be an array");
  // A chat's template puts the special tokens in itself: vLLM's default for a chat is false.
  const special = flag(body, 'add_special_tokens', !chat);
  if (chat && !flag(body, 'add_generation_prompt', true))
    throw new HttpError(400, "'add_generation_prompt': false is not supported (the worker always adds it)");
  if (chat && flag(body, 'continue_final_message', false))
    throw new HttpError(400, "'continue_final_message' is not supported");
  if (flag(body, 'return_token_strs', false)) throw new HttpError(400, "'return_token_strs' is not supported");
  const req: GenerationRequest = {
    chat,
    prompt: chat ? '' : (body.prompt as string),
    messages: chat ? (body.messages as GenerationRequest['messages']) : [],
    maxTokens: 1,
    temperature: 0,
    stop: [],
  };
  let tokens: number[];
  try {
    tokens = [...w.model.promptTokenIds(req)];
  } catch (e) {
    throw e instanceof HttpError ? e : new HttpError(400, (e as Error).message);
  }
  // A model gives no ids for a chat it cannot render (a role it does not take): a 400, as the chat itself gets.
  if (chat && tokens.length === 0) throw new HttpError(400, "'messages' are not a chat this model can render");
  const bos = w.model.tokenizer?.bos;
  if (!chat && !special && bos !== undefined && tokens[0] === bos) tokens.shift();
  return { count: tokens.length, max_model_len: w.healthInfo().max_model_len ?? null, tokens };
}

/** POST /detokenize: {tokens} -> {prompt}. */
export function detokenizeBody(w: TokenizeHandler, body: Record<string, unknown>): Record<string, unknown> {
  checkModel(w, body);
  const t = w.model.tokenizer;
  if (!t) throw new HttpError(501, 'this model cannot detokenize', 'not_implemented');
  const ids = body.tokens;
  if (!Array.isArray(ids) || !ids.every((i) => Number.isSafeInteger(i) && i >= 0 && i < t.vocabSize))
    throw new HttpError(400, `'tokens' must be an array of token ids below ${t.vocabSize}`);
  return { prompt: t.decode(ids as number[]) };
}
