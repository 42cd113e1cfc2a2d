// What a failure means, in one table (as Dynamo keeps one migration table):
// for each error `type` a worker or the proxy answers with, its HTTP status,
// whether the proxy runs the stage again on another worker, whether it takes
// the worker that answered it out of rotation, and the status the client gets
// once the proxy has no other worker to try. Workers build their errors from
// here (failure(), kvFailure()); the proxy reads the same rows (ruleOf()), so a
// code means one thing on both sides of the wire.
import { HttpError } from './http';

/** What one error type means to the worker that answers it and to the proxy that reads it. */
export interface FailureRule {
  /** The worker's (or the proxy's own) HTTP status for it. */
  status: number;
  /** The proxy tries another worker of the same stage (a 5xx a next worker may not have). */
  retry: boolean;
  /** The proxy takes the worker out until its health check passes again. */
  eject: boolean;
  /** The client's status once every worker tried answered this (the stage's own status otherwise). */
  exhausted?: number;
  /** Seconds a client should wait before trying again (Retry-After). */
  retryAfterS?: number;
  /** Why, for docs/serving.md's table. */
  why: string;
}

/** Every error type nixl-node answers with, by the `type` (HTTP) or `code` (ZeroMQ) field of its error body. */
export const FAILURES = {
  invalid_request_error: { status: 400, retry: false, eject: false, why: 'the request is malformed' },
  unsupported_parameter: { status: 400, retry: false, eject: false, why: 'a field asks for what is not served' },
  kv_request_too_large: { status: 400, retry: false, eject: false, why: 'the prompt needs more blocks than exist' },
  kv_mode_mismatch: {
    status: 400,
    retry: false,
    eject: false,
    why: 'push asked of a pull worker, or of a model that cannot',
  },
  NotFoundError: { status: 404, retry: false, eject: false, why: 'no such model or route' },
  aborted: { status: 499, retry: false, eject: false, why: 'the client went away' },
  internal_error: { status: 500, retry: true, eject: false, exhausted: 502, why: 'a fault of this worker' },
  kv_mismatch: { status: 500, retry: true, eject: false, exhausted: 502, why: 'KV state of another layout' },
  kv_push_unsized: { status: 500, retry: true, eject: false, exhausted: 502, why: 'KV that cannot be pushed' },
  not_implemented: {
    status: 501,
    retry: true,
    eject: false,
    exhausted: 502,
    why: 'a route this worker does not serve (another may)',
  },
  kv_push_refused: {
    status: 502,
    retry: false,
    eject: false,
    exhausted: 502,
    why: 'the prefill refused the registration',
  },
  kv_rejected: { status: 502, retry: true, eject: false, exhausted: 502, why: 'KV state failed its checks' },
  kv_expired: { status: 503, retry: true, eject: false, exhausted: 503, why: "the prefill's lease ran out" },
  kv_cache_full: {
    status: 503,
    retry: true,
    eject: false,
    exhausted: 503,
    retryAfterS: 1,
    why: 'no free KV blocks before --kv-wait-ms',
  },
  kv_queue_full: {
    status: 503,
    retry: true,
    eject: false,
    exhausted: 503,
    retryAfterS: 1,
    why: 'the block queue is at --kv-queue-max',
  },
  kv_push_timeout: {
    status: 504,
    retry: false,
    eject: false,
    exhausted: 502,
    why: 'the pushed KV did not arrive in time (the proxy answers 502: a worker failed, not the proxy)',
  },
  stage_timeout: { status: 504, retry: true, eject: true, exhausted: 504, why: 'the worker did not answer in time' },
  unreachable: { status: 502, retry: true, eject: true, exhausted: 502, why: 'the worker cannot be reached' },
} as const satisfies Record<string, FailureRule>;

export type FailureType = keyof typeof FAILURES;

/** An unknown type (a vLLM worker's own, or a NixlError code) is read by its status class. */
const UNKNOWN_4XX: FailureRule = { status: 400, retry: false, eject: false, why: "the request's fault" };
const UNKNOWN_5XX: FailureRule = { status: 502, retry: true, eject: false, exhausted: 502, why: "a worker's fault" };

/** The rule for an error body's type (or ZeroMQ code) and the status it came with. */
export function ruleOf(type: string | undefined, status: number): FailureRule {
  const known = type !== undefined && Object.hasOwn(FAILURES, type) ? FAILURES[type as FailureType] : undefined;
  if (known) return known;
  return status < 500 ? { ...UNKNOWN_4XX, status } : { ...UNKNOWN_5XX, status };
}

/** The Retry-After header an answer of this type carries. */
export function retryAfterHeader(type: string | undefined): Record<string, string> {
  const r =
    type !== undefined && Object.hasOwn(FAILURES, type) ? (FAILURES[type as FailureType] as FailureRule) : undefined;
  return r?.retryAfterS !== undefined ? { 'retry-after': String(r.retryAfterS) } : {};
}

/** The error a worker (or the proxy) answers with, its status from the table. */
export function failure(type: FailureType, message: string, details?: Record<string, unknown>): HttpError {
  return new HttpError(FAILURES[type].status, message, type, details);
}
