// A worker's failures as the client gets them, built from the one table
// (api/errors.ts): a pull that broke off, a push that did, a model that
// refused the request, anything else. A NixlError's code stays the `type` of
// a KV failure that is not in the table (clients and tests read it).
import { NixlError } from '../../errors';
import type { PullError } from '../../kv/pull/types';
import { PushError } from '../../kv/push/types';
import { failure } from '../api/errors';
import { HttpError } from '../api/http';
import { ModelRequestError } from '../models/types';

/** Any error of a request as the front answers it. */
export function httpErrorOf(e: unknown, signal: AbortSignal): HttpError {
  if (e instanceof HttpError) return e;
  if (e instanceof PushError) return pushFailure(e, signal);
  if (e instanceof ModelRequestError)
    return e.status === 499 ? failure('aborted', e.message) : new HttpError(e.status, e.message);
  if (signal.aborted) return failure('aborted', 'the client went away');
  return failure('internal_error', (e as Error)?.message ?? String(e));
}

/**
 * A pull that failed: expired (the proxy prefills again), refused (what the
 * params name does not fit: the request's fault, not this worker's), or
 * broken off.
 */
export function pullFailure(e: unknown): HttpError {
  const err = e as PullError;
  if (err.kind === 'expired') return failure('kv_expired', `KV pull failed (expired): ${err.message}`);
  const refused = err.kind === 'setup' || err.code === 'NIXL_ERR_MISMATCH';
  return new HttpError(refused ? 400 : 502, `KV pull failed (${err.kind}): ${err.message}`, err.code);
}

/** kv_transfer_params a pull would refuse before reading anything (as the puller words it). */
export function pullSetupFailure(requestId: unknown, e: unknown): HttpError {
  const err = e as NixlError;
  const code = err instanceof NixlError ? err.code : 'NIXL_ERR_INVALID_PARAM';
  const msg = `pull of request '${String(requestId ?? '')}' from kv_transfer_params failed (setup): ${err.message}`;
  return new HttpError(400, `KV pull failed (setup): ${msg}`, code);
}

/** A push that failed: never retried by the proxy (the prefill may have written part of it). */
export function pushFailure(e: unknown, signal: AbortSignal): HttpError {
  if (!(e instanceof PushError))
    return e instanceof HttpError ? e : new HttpError(502, String((e as Error)?.message ?? e));
  if (e.kind === 'aborted' || signal.aborted) return failure('aborted', e.message);
  if (e.kind === 'timeout') return failure('kv_push_timeout', `KV push failed (timeout): ${e.message}`);
  if (e.kind === 'setup') return new HttpError(400, `KV push failed (setup): ${e.message}`, e.code);
  if (e.kind === 'refused')
    return failure('kv_push_refused', `KV push failed (refused by the prefill): ${e.message}`, { nixl_code: e.code });
  return new HttpError(502, `KV push failed (${e.kind}): ${e.message}`, e.code);
}

/** kv_transfer_params that do not parse (`code`: the type, when not invalid_request_error). */
export function badParams(e: unknown, code?: string): HttpError {
  return new HttpError(400, `kv_transfer_params: ${(e as Error).message}`, code);
}

/** An error as a front answers it (a request's errors are HttpErrors already; anything else is this worker's fault). */
export function answered(e: unknown): HttpError {
  return e instanceof HttpError ? e : failure('internal_error', (e as Error)?.message ?? String(e));
}

/** A release naming its request by something other than a string. */
export function notAString(field: string): HttpError {
  return failure('invalid_request_error', `'${field}' must be a string`);
}
