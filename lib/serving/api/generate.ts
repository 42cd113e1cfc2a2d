// vLLM's token-in/token-out endpoint, POST /inference/v1/generate: the
// request's checks (as vLLM makes them: token_ids required, >= 1 of them,
// none negative or outside the vocabulary; an unknown model is a 404) and the
// proxy's two legs. The worker's handling is worker/fronts/generate-route.ts.
// kv_transfer_params ride at the top level; older peers put them in
// sampling_params.extra_args, read too (the top level wins).
import { RequestError, checkBody } from './body-schemas';
import { unsupportedField } from './unsupported';

export const GENERATE_PATH = '/inference/v1/generate';

/** Longest generation a worker runs in one request. */
export const MAX_NEW_TOKENS = 4096;

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
