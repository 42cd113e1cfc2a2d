// A worker's side of vLLM's POST /inference/v1/generate: the model evaluates
// the ids; the text it generates becomes ids again through its tokenizer;
// prefill, decode and aggregated as for /v1/completions.
import { randomUUID } from 'node:crypto';
import { HttpError } from '../../api/http';
import type { ModelTokenizer } from '../../models/types';
import { GENERATE_PATH, MAX_NEW_TOKENS, checkGenerateRequest, generateKvParams } from '../../api/generate';
import type { FrontHandler, Sink, WorkerRequest } from './front';

type Obj = Record<string, unknown>;
const isObject = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);
/**
 * Where a completion body carries the prompt's ids to the model (a symbol:
 * never in JSON, so no client sets it past these checks).
 */
export const PROMPT_TOKENS = Symbol('nixl-node.promptTokens');

/** The ids the model evaluates (its own beginning-of-sequence id left to it); 400 for one outside the vocabulary. */
function promptIds(tok: ModelTokenizer, ids: number[]): number[] {
  for (let i = 0; i < ids.length; i++)
    if (ids[i] >= tok.vocabSize)
      throw new HttpError(400, `'token_ids[${i}]' = ${ids[i]} is outside the vocabulary (${tok.vocabSize} tokens)`);
  return ids.length > 1 && tok.bos !== undefined && ids[0] === tok.bos ? ids.slice(1) : ids;
}

/**
 * One generate request on a worker: checked, then served as the
 * /v1/completions request it stands for, the answer turned back into
 * vLLM's generate shape (token ids; kv_transfer_params at the top level,
 * and on a stream's last chunk). Throws HttpError.
 */
export async function handleGenerate(w: FrontHandler, q: WorkerRequest): Promise<void> {
  const { body, requestId: headerId } = q;
  try {
    checkGenerateRequest(body, { kvTransferParams: 'object' });
  } catch (e) {
    throw e instanceof HttpError ? e : new HttpError(400, (e as Error).message);
  }
  if (typeof body.model === 'string' && !(w.servedModelNames ?? [w.modelId]).includes(body.model))
    throw new HttpError(404, `The model \`${body.model.slice(0, 200)}\` does not exist.`, 'NotFoundError');
  const tok = w.model.tokenizer;
  if (!tok) throw new HttpError(400, `model ${w.modelId} has no tokenizer: token ids are not supported`);
  const ids = body.token_ids as number[];
  const prompt = promptIds(tok, ids);
  const sp = body.sampling_params as Obj;
  // As vLLM: no max_tokens means what the context leaves, not 16.
  // The model's own BOS takes a place in its context too.
  const used = prompt.length + (tok.bos !== undefined ? 1 : 0);
  const room = tok.contextTokens === undefined ? MAX_NEW_TOKENS : tok.contextTokens - used;
  const maxTokens = (sp.max_tokens as number | undefined | null) ?? Math.max(1, Math.min(MAX_NEW_TOKENS, room));
  const kv = generateKvParams(body);
  const completion: Record<string | symbol, unknown> = {
    model: w.modelId,
    // What the ids spell, for logs and checks; the model evaluates the ids.
    prompt: tok.decode(prompt),
    [PROMPT_TOKENS]: prompt,
    max_tokens: maxTokens,
    ...(sp.temperature != null ? { temperature: sp.temperature } : {}),
    ...(sp.top_p != null ? { top_p: sp.top_p } : {}),
    ...(sp.seed != null ? { seed: sp.seed } : {}),
    ...(sp.stop != null ? { stop: sp.stop } : {}),
    stream: body.stream === true,
    ...(isObject(body.stream_options) ? { stream_options: body.stream_options } : {}),
    ...(kv ? { kv_transfer_params: kv } : {}),
  };
  const base =
    typeof headerId === 'string' && headerId.length > 0
      ? headerId
      : typeof body.request_id === 'string'
        ? body.request_id
        : randomUUID();
  const id = `generate-tokens-${base}`;
  const out = generateSink(q.sink, id, tok, maxTokens);
  await w.handle({ ...q, path: '/v1/completions', body: completion as Obj, requestId: id, sink: out });
}

/**
 * Turns a worker's completion answer (whole or chunks) into generate's
 * shape: the text in ids again, at most `maxTokens` of them (the model's
 * text may encode to more ids than it generated tokens), and usage that
 * counts the ids returned.
 */
function generateSink(sink: Sink, id: string, tok: ModelTokenizer, maxTokens: number): Sink {
  let returned = 0;
  let cut = false;
  const idsOf = (text: unknown): number[] => {
    if (typeof text !== 'string' || text.length === 0) return [];
    const all = tok.encode(text);
    const ids = all.slice(0, Math.max(0, maxTokens - returned));
    cut ||= ids.length < all.length;
    returned += ids.length;
    return ids;
  };
  const choicesOf = (b: Obj) =>
    ((b.choices as Obj[] | undefined) ?? []).map((c) => {
      const token_ids = idsOf(c.text);
      const done = c.finish_reason ?? null;
      return { index: c.index ?? 0, token_ids, finish_reason: cut && done !== null ? 'length' : done, logprobs: null };
    });
  const usageOf = (u: unknown) => {
    if (!u || typeof u !== 'object') return u;
    const prompt = Number((u as Obj).prompt_tokens ?? 0);
    return { ...(u as Obj), completion_tokens: returned, total_tokens: prompt + returned };
  };
  const extras = (b: Obj) => ({
    ...(b.usage !== undefined ? { usage: usageOf(b.usage) } : {}),
    ...(b.kv_transfer_params !== undefined ? { kv_transfer_params: b.kv_transfer_params } : {}),
    ...(b.nixl_node !== undefined ? { nixl_node: b.nixl_node } : {}),
  });
  return {
    chunk: (c) => {
      const choices = choicesOf(c);
      // Past max_tokens a chunk of text alone says nothing any more.
      const empty = choices.every((x) => x.token_ids.length === 0 && x.finish_reason === null);
      if (cut && empty && c.usage === undefined && c.kv_transfer_params === undefined && c.nixl_node === undefined)
        return;
      sink.chunk({ request_id: id, choices, ...extras(c) });
    },
    end: (status, b) => {
      if (!b || b.error !== undefined) return sink.end(status, b);
      const choices = choicesOf(b).map((c) => ({ ...c, finish_reason: c.finish_reason ?? 'stop' }));
      sink.end(status, {
        request_id: id,
        model: b.model,
        created: b.created,
        choices,
        prompt_logprobs: null,
        ...extras(b),
        kv_transfer_params: b.kv_transfer_params ?? null,
      });
    },
  };
}

/** What a worker's front calls for a POST: the generate endpoint here, every other route on the worker. */
export function serveRoute(w: FrontHandler, q: WorkerRequest): Promise<void> {
  return q.path === GENERATE_PATH ? handleGenerate(w, q) : w.handle(q);
}
