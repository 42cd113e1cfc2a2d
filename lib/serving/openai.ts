// OpenAI API details the proxy and the workers share: the array forms of a
// completion's `prompt`, and the 404 of a model nobody serves (vLLM's answer).
import { HttpError } from './http';

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
