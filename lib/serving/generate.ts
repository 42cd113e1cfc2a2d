// vLLM's token-in/token-out endpoint, POST /inference/v1/generate: the
// request's checks (as vLLM makes them: token_ids required, >= 1 of them,
// none negative or outside the vocabulary; an unknown model is a 404), the
// worker's handling (the model evaluates the ids; the text it generates
// becomes ids again through its tokenizer; prefill, decode and aggregated as
// for /v1/completions), and the proxy's two legs.
// kv_transfer_params ride at the top level; older peers put them in
// sampling_params.extra_args, read too (the top level wins).
import { randomUUID } from 'node:crypto';
import { HttpError } from './http';
import type { ModelTokenizer } from './models/types';
import { RequestError, checkBody } from './body-schemas';
import { unsupportedField } from './unsupported';
import type { FrontHandler as Worker, RequestHints, Sink } from './front';

export const GENERATE_PATH = '/inference/v1/generate';

/** Longest generation a worker runs in one request. */
const MAX_NEW_TOKENS = 4096;

type Obj = Record<string, unknown>;
const isObject = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);
const bad = (m: string, param: string): never => {
  throw new RequestError(400, m, param);
};
function optional(b: Obj, key: string, ok: (v: unknown) => boolean, what: string, where = ''): void {
  if (b[key] !== undefined && b[key] !== null && !ok(b[key])) bad(`'${where}${key}' must be ${what}`, where + key);
}

/** What a nixl-node worker honours of the sampling parameters vLLM defines: the others only at their no-op values. */
function checkOwnSamplingParams(s: Obj): void {
  const w = 'sampling_params.';
  if (typeof s.max_tokens === 'number' && s.max_tokens > MAX_NEW_TOKENS)
    bad(`'sampling_params.max_tokens' must be at most ${MAX_NEW_TOKENS}`, 'sampling_params.max_tokens');
  optional(s, 'n', (v) => v === 1, '1 (one sequence per request)', w);
  optional(s, 'min_tokens', (v) => v === 0, '0 (not supported)', w);
  optional(s, 'logprobs', () => false, 'null (logprobs are not supported)', w);
  optional(s, 'prompt_logprobs', () => false, 'null (logprobs are not supported)', w);
  optional(s, 'detokenize', (v) => typeof v === 'boolean', 'a boolean', w);
  optional(
    s,
    'stop_token_ids',
    (v) => Array.isArray(v) && v.length === 0,
    'empty (stop token ids are not supported; use stop)',
    w,
  );
  optional(
    s,
    'stop',
    (v) => typeof v === 'string' || (Array.isArray(v) && v.length <= 16 && v.every((x) => typeof x === 'string')),
    'a string or an array of at most 16 strings',
    w,
  );
}

export interface GenerateCheckOptions {
  /** 'object': a nixl-node worker (takes kv_transfer_params, checks what it honours); 'refuse': the proxy (clients send none). */
  kvTransferParams: 'refuse' | 'object';
}

/**
 * Throws RequestError (400) naming the first field that is wrong: vLLM's
 * checks (docs/generate-request.schema.json), then on a worker what it
 * honours.
 */
export function checkGenerateRequest(b: Obj, o: GenerateCheckOptions): void {
  checkBody('generate-request', b);
  const refused = unsupportedField({ cache_salt: b.cache_salt });
  if (refused) throw new RequestError(400, refused.message, refused.param, 'unsupported_parameter');
  const sp = b.sampling_params as Obj;
  if (o.kvTransferParams === 'object') {
    checkOwnSamplingParams(sp);
    optional(b, 'features', () => false, 'null (multimodal features are not supported)');
    optional(b, 'output_mode', (v) => v === 'tokens', "'tokens'");
    return;
  }
  const nested = sp.extra_args as Obj | undefined | null;
  for (const [where, v] of [
    ['kv_transfer_params', b.kv_transfer_params],
    ['sampling_params.extra_args.kv_transfer_params', nested?.kv_transfer_params],
  ] as const)
    if (v !== undefined && v !== null) bad(`'${where}' is set by the proxy, not by clients`, where);
}

/** The request's kv_transfer_params: top level, else sampling_params.extra_args (older routers). */
export function generateKvParams(b: Obj): Obj | undefined {
  if (isObject(b.kv_transfer_params)) return b.kv_transfer_params;
  const nested = ((b.sampling_params as Obj | undefined)?.extra_args as Obj | undefined)?.kv_transfer_params;
  return isObject(nested) ? nested : undefined;
}

/** A body with `kv` in both places vLLM reads it (new engines: top level; before #42644: extra_args). */
function withParams(body: Obj, sp: Obj, kv: Obj): Obj {
  return {
    ...body,
    sampling_params: {
      ...sp,
      extra_args: { ...(isObject(sp.extra_args) ? sp.extra_args : {}), kv_transfer_params: kv },
    },
    kv_transfer_params: kv,
  };
}

/** The proxy's prefill leg: one token, not streamed, the prefill's request params in both places. */
export function generatePrefillBody(body: Obj, kv: Obj): Obj {
  const sp: Obj = { ...(body.sampling_params as Obj), max_tokens: 1 };
  delete sp.min_tokens;
  const b = withParams({ ...body, stream: false }, sp, kv);
  delete b.stream_options;
  return b;
}

/** The proxy's decode leg: the client's request, with the prefill's params in both places. */
export function generateDecodeBody(body: Obj, kv: Obj): Obj {
  return withParams(body, body.sampling_params as Obj, kv);
}

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
export async function handleGenerate(
  w: Worker,
  body: Obj,
  headerId: unknown,
  signal: AbortSignal,
  sink: Sink,
  traceparent?: unknown,
  hints: RequestHints = {},
): Promise<void> {
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
  const out = generateSink(sink, id, tok, maxTokens);
  await w.handle('/v1/completions', completion as Obj, id, signal, out, traceparent, hints);
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
export function serveRoute(
  w: Worker,
  path: string,
  body: Obj,
  requestId: string,
  signal: AbortSignal,
  sink: Sink,
  traceparent?: unknown,
  hints: RequestHints = {},
): Promise<void> {
  if (path === GENERATE_PATH) return handleGenerate(w, body, requestId, signal, sink, traceparent, hints);
  return w.handle(path, body, requestId, signal, sink, traceparent, hints);
}
