// The OpenAI-compatible response shapes the proxy and the workers answer
// with: completions and chat completions (whole and streamed), usage, the
// model list, and the error body.

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
  model: string,
  chat: boolean,
  text: string,
  finish: string | null,
): Record<string, unknown> {
  return chat
    ? {
        id,
        object: 'chat.completion.chunk',
        model,
        choices: [{ index: 0, delta: { content: text }, finish_reason: finish }],
      }
    : { id, object: 'text_completion', model, choices: [{ index: 0, text, finish_reason: finish }] };
}
