// What push mode's two sides are asked and answer: the public shapes of
// KvPushReceiver (decode) and KvPushSender (prefill).
import { NixlError } from '../errors';
import type { TraceContext } from '../tracing';

/**
 * Why a push receive failed. `timeout`: not every WRITE notification came
 * by the deadline; `mismatch`: a notification or the prefill did not fit the
 * request; `peer-gone`: the registration could not be delivered;
 * `refused`: a nixl-node prefill said it will not write this registration
 * (another block count than its KV, a failed handshake back...), and why.
 */
export type PushFailure = 'setup' | 'handshake' | 'mismatch' | 'timeout' | 'peer-gone' | 'aborted' | 'refused';

/**
 * A failed push receive: the local blocks named here hold no valid KV. When
 * `quarantinedUntilMs` is set the registration went out, a WRITE may still
 * land, and the blocks must not be reused before that time (performance.now()
 * ms; the receiver's quarantine refuses them until then).
 */
export class PushError extends NixlError {
  constructor(
    message: string,
    code: string,
    readonly kind: PushFailure,
    readonly requestId: string,
    readonly localBlockIds: number[],
    readonly quarantinedUntilMs: number | undefined,
    cause?: unknown,
  ) {
    super(message, code, undefined, { cause });
    this.name = 'PushError';
  }

  /** @internal */
  static of(kind: PushFailure, e: unknown, requestId: string, ids: number[], until?: number): PushError {
    const err = e as NixlError;
    const q = until === undefined ? '' : '; its blocks are in quarantine until the prefill can no longer WRITE';
    return new PushError(
      `push receive of request '${requestId}' failed (${kind}): ${err?.message ?? e}${q}`,
      err?.code ?? 'NIXL_ERR_UNKNOWN',
      kind,
      requestId,
      ids,
      until,
      e,
    );
  }
}

/** One receive: our request id and our blocks. */
export interface ReceiveOptions {
  /** The decode's own request id: the prefill's WRITE notifications carry it (vLLM's push). */
  requestId: string;
  /** Our logical block ids to be written (one KV-cache group), as a list or as [list]. */
  localBlockIds: ArrayLike<number> | ArrayLike<number>[];
  /** Deadline from now, ms. Default: the receiver's timeoutMs. */
  timeoutMs?: number;
  signal?: AbortSignal;
  traceContext?: TraceContext;
}

/** A completed receive: every expected WRITE notification came. */
export interface PushReceived {
  requestId: string;
  /** WRITE notifications counted (pp_size x max(1, P_tp // D_tp)). */
  notifications: number;
  /** The prefill agents that wrote. */
  writers: string[];
  waitedMs: number;
}
