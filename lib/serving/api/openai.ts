// The OpenAI-compatible response shapes the proxy and the workers answer
// with: completions and chat completions (whole and streamed), usage, the
// model list, the error body; the array forms of a completion's `prompt`, and
// the 404 of a model nobody serves (vLLM's answer).
import { HttpError } from './http';

/** Token counts of one answer. */
export interface Usage {
  prompt: number;
  completion: number;
}

/** OpenAI's error body. @internal */
export function errorBody(message: string, type: string, extra: Record<string, unknown> = {}): Record<string, unknown> {
  return { error: { message, type, ...extra } };
}

/** GET /v1/models. @internal */
export function modelList(ids: readonly string[]): Record<string, unknown> {
  return { object: 'list', data: ids.map((id) => ({ id, object: 'model', owned_by: 'nixl-node' })) };
}

/** @internal */
export function usageBody(u: Usage): Record<string, number> {
  return { prompt_tokens: u.prompt, completion_tokens: u.completion, total_tokens: u.prompt + u.completion };
}

/**
 * The id of an answer to request `requestId`, as OpenAI and vLLM give it:
 * chatcmpl-... for chat, cmpl-... for completions (vLLM: the prefix, then
 * the X-Request-Id it was given). @internal
 */
export function responseId(requestId: string, chat: boolean): string {
  return `${chat ? 'chatcmpl' : 'cmpl'}-${requestId}`;
}

/**
 * The proxy's answer to a client that sent its own X-Request-Id: the same
 * answer, its id made of the client's (the workers were given the proxy's
 * own id, unique in flight). @internal
 */
export function withClientId<T>(body: T, clientId: string | undefined): T {
  const b = body as Record<string, unknown> | undefined;
  if (clientId === undefined || typeof b?.id !== 'string') return body;
  const m = /^(chatcmpl|cmpl)-/.exec(b.id);
  return m ? ({ ...b, id: `${m[1]}-${clientId}` } as T) : body;
}

/** A whole answer: chat.completion or text_completion. @internal */
export function completionBody(
  id: string,
  model: string,
  chat: boolean,
  text: string,
  finish: string,
  usage: Usage,
): Record<string, unknown> {
  const created = Math.floor(Date.now() / 1000);
  id = responseId(id, chat);
  return chat
    ? {
        id,
        object: 'chat.completion',
        created,
        model,
        choices: [{ index: 0, message: { role: 'assistant', content: text }, finish_reason: finish }],
        usage: usageBody(usage),
      }
    : {
        id,
        object: 'text_completion',
        created,
        model,
        choices: [{ index: 0, text, finish_reason: finish }],
        usage: usageBody(usage),
      };
}

/** One streamed chunk. @internal */
export function chunkBody(
  id: string,
  created: number,
  model: string,
  chat: boolean,
  text: string,
  finish: string | null,
): Record<string, unknown> {
  id = responseId(id, chat);
  return chat
    ? {
        id,
        object: 'chat.completion.chunk',
        created,
        model,
        choices: [{ index: 0, delta: { content: text }, finish_reason: finish }],
      }
    : { id, object: 'text_completion', created, model, choices: [{ index: 0, text, finish_reason: finish }] };
}

/**
 * `prompt` as a list of one string is that string (what the official
 * clients send for `prompt: ['...']`). Several prompts in one request are a
 * 400: the proxy moves one prompt's KV per request (send one request each).
 * Token-id lists are a 400 too: the workers take text.
 */
export function normalizePrompt(body: Record<string, unknown>): void {
  const p = body.prompt;
  if (!Array.isArray(p)) return;
  if (p.length === 1 && typeof p[0] === 'string') {
    body.prompt = p[0];
    return;
  }
  if (p.length > 1 && p.every((x) => typeof x === 'string'))
    throw new HttpError(400, `'prompt' holds ${p.length} prompts: send one per request`);
  throw new HttpError(400, "'prompt' must be a string or a list of one string (token ids are not taken)");
}

/** The 404 of a model that is not served here, as OpenAI and vLLM answer it. */
export class ModelNotFound extends HttpError {
  constructor(
    model: string,
    readonly served: readonly string[],
  ) {
    super(
      404,
      `The model '${model}' does not exist${served.length ? ` (served here: ${served.join(', ')})` : ''}`,
      'model_not_found',
    );
  }
}

/** OpenAI's error object for ModelNotFound: type invalid_request_error, code model_not_found, param model. */
export function modelNotFoundBody(e: ModelNotFound): Record<string, unknown> {
  return { error: { message: e.message, type: 'invalid_request_error', param: 'model', code: 'model_not_found' } };
}
