// The end of an answer that may be streamed. A streamed answer whose
// request produced kv_transfer_params (a prefill asked to stream) ends with
// a chunk that carries them at the top level, as vLLM #40186 does, so a
// streaming client can continue from it; then the stream's end.
import type { Sink } from './fronts/front';

/** The last SSE chunk of a whole /v1/completions or /v1/chat/completions answer. */
export function lastChunkOf(body: Record<string, unknown>, includeUsage: boolean): Record<string, unknown> {
  const chat = body.object === 'chat.completion';
  const choices = (body.choices as Array<Record<string, unknown>> | undefined) ?? [];
  const chunk: Record<string, unknown> = {
    id: body.id,
    object: chat ? 'chat.completion.chunk' : 'text_completion',
    created: body.created,
    model: body.model,
    choices: choices.map((c) =>
      chat
        ? {
            index: c.index ?? 0,
            delta: (c.message as Record<string, unknown> | undefined) ?? {},
            finish_reason: c.finish_reason ?? null,
          }
        : { index: c.index ?? 0, text: c.text ?? '', finish_reason: c.finish_reason ?? null },
    ),
  };
  if (includeUsage && body.usage !== undefined) chunk.usage = body.usage;
  if (body.kv_transfer_params !== undefined) chunk.kv_transfer_params = body.kv_transfer_params;
  if (body.nixl_node !== undefined) chunk.nixl_node = body.nixl_node;
  return chunk;
}

/** Ends an answer: whole (JSON), or, when the request streams, as one last chunk and the stream's end. */
export function endAnswer(sink: Sink, body: Record<string, unknown>, request: Record<string, unknown>): void {
  if (request.stream !== true) {
    sink.end(200, body);
    return;
  }
  const includeUsage = (request.stream_options as { include_usage?: unknown } | null)?.include_usage === true;
  sink.chunk(lastChunkOf(body, includeUsage));
  sink.end(200);
}
