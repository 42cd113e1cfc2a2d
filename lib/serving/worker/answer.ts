// What a worker answers: the request as a model takes it (from the OpenAI
// body), and the answer as it goes out (streamed chunks or one body, then the
// end with its usage and nixl_node fields).
import { failure } from '../api/errors';
import { chunkBody, completionBody, usageBody } from '../api/openai';
import type { ChatMessage, Generated, GenerationRequest } from '../models/types';
import type { Sink } from './fronts/front';
import { PROMPT_TOKENS } from './fronts/generate-route';
import type { HeldTurn } from './turns';

/** An answer on its way out: the text as it comes (streamed, or kept), then the end. */
export class Answer {
  #text = '';
  /** The whole text, streamed or not (what a decode holds the KV of for the next turn). */
  whole = '';
  readonly #stream: boolean;
  /** One creation time for every chunk of a stream, as OpenAI's. */
  readonly #created = Math.floor(Date.now() / 1000);

  constructor(
    readonly id: string,
    readonly model: string,
    readonly chat: boolean,
    readonly body: Record<string, unknown>,
    readonly sink: Sink,
  ) {
    this.#stream = body.stream === true;
  }

  readonly text = (t: string): void => {
    if (t.length === 0) return;
    this.whole += t;
    this.sink.token?.();
    if (!this.#stream) {
      this.#text += t;
      return;
    }
    this.sink.chunk(chunkBody(this.id, this.#created, this.model, this.chat, t, null));
  };

  /** The end; `turn`: the turn's KV this decode holds (bidirectional KV): its params, on the last chunk when streamed. */
  finish(g: Generated, info: Record<string, unknown>, turn?: HeldTurn): void {
    const usage = { prompt: g.promptTokens, completion: g.completionTokens };
    const next = turn ? { kv_transfer_params: turn.params } : {};
    if (turn) info = { ...info, kv_hold_ms: turn.holdMs };
    if (!this.#stream) {
      this.sink.end(200, {
        ...completionBody(this.id, this.model, this.chat, this.#text, g.finishReason, usage),
        ...next,
        nixl_node: info,
      });
      return;
    }
    this.sink.chunk({
      ...chunkBody(this.id, this.#created, this.model, this.chat, '', g.finishReason),
      ...next,
      nixl_node: info,
    });
    // OpenAI's stream_options.include_usage: one more chunk, with no choices, that carries the usage.
    if ((this.body.stream_options as { include_usage?: unknown } | null)?.include_usage === true) {
      const { choices: _, ...head } = chunkBody(this.id, this.#created, this.model, this.chat, '', null);
      this.sink.chunk({ ...head, choices: [], usage: usageBody(usage) });
    }
    this.sink.end(200);
  }
}

/** The request as a model takes it (the body was checked by checkCompletionRequest). */
export function generationRequest(path: string, body: Record<string | symbol, unknown>): GenerationRequest {
  const maxTokens = Number(body.max_tokens ?? body.max_completion_tokens ?? 16);
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > 4096)
    throw failure('invalid_request_error', "'max_tokens' must be an integer from 1 to 4096");
  const stop =
    body.stop === undefined || body.stop === null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop;
  return {
    chat: path === '/v1/chat/completions',
    prompt: typeof body.prompt === 'string' ? body.prompt : '',
    messages: (body.messages as ChatMessage[] | undefined) ?? [],
    ...(body[PROMPT_TOKENS] ? { promptTokens: body[PROMPT_TOKENS] as number[] } : {}),
    maxTokens,
    // OpenAI's and vLLM's default.
    temperature: (body.temperature as number | undefined) ?? 1,
    topP: body.top_p as number | undefined,
    seed: body.seed as number | undefined,
    stop: (stop as string[]).filter((s) => s.length > 0),
  };
}
