// A worker's counters, and the one place that says which counter a freed
// hold goes to (a prefill's hold, a push offer or a held turn, whatever
// freed it).

/** A worker's counters. */
export interface WorkerStats {
  prefills: number;
  decodes: number;
  encodes: number;
  aggregated: number;
  failed: number;
  verifiedBytes: number;
  badBytes: number;
  /** Decode: KV it was given and refused to load (wrong bytes, another model, truncated, corrupted). */
  rejectedKv: number;
  freedByRead: number;
  freedByLease: number;
  /** Decode: pulls refused or failed because the prefill's lease ran out (or would have) first. */
  pullsExpired: number;
  /** Prefill: reads reported after a request's lease ran out. */
  lateReads: number;
  /** Prefill: holds released early because the proxy said the decode would not read them. */
  abortedHolds: number;
  /** Prefill (push): pushes that failed, never retried (a registration refused, a WRITE failed); blocks freed. */
  failedPushes: number;
  /** ZeroMQ: answers dropped because their reply_to is not an address a PUSH socket can connect to. */
  repliesDropped: number;
  /** ZeroMQ: messages dropped unanswered: unreadable (not two frames, not a msgpack map) or with no usable reply_to. */
  messagesDropped: number;
  /** Time spent taking KV out of the model into blocks (prefill), moving it (decode: pulled or pushed), putting it back in (decode), ms. */
  kvSaveMs: number;
  kvPullMs: number;
  kvLoadMs: number;
  /** Prefill (GGUF): prefills that reused a cached prefix, prompt tokens taken from one, and prompt tokens evaluated. */
  prefixHits: number;
  prefixReusedTokens: number;
  prefillEvaluatedTokens: number;
  /** Prefill: time in the model's prefill (evaluating and taking the KV out), ms. */
  prefillMs: number;
}

/** Every counter at 0. */
export function newStats(): WorkerStats {
  return {
    prefills: 0,
    decodes: 0,
    encodes: 0,
    aggregated: 0,
    failed: 0,
    verifiedBytes: 0,
    badBytes: 0,
    rejectedKv: 0,
    freedByRead: 0,
    freedByLease: 0,
    pullsExpired: 0,
    lateReads: 0,
    abortedHolds: 0,
    failedPushes: 0,
    repliesDropped: 0,
    messagesDropped: 0,
    kvSaveMs: 0,
    kvPullMs: 0,
    kvLoadMs: 0,
    prefixHits: 0,
    prefixReusedTokens: 0,
    prefillEvaluatedTokens: 0,
    prefillMs: 0,
  };
}

/**
 * Why a hold's blocks went back: read (a pull read them, or a push wrote
 * them), aborted (no decode will read them), failed (a push that broke off),
 * expired (the lease ran out, or the worker closed).
 */
export type ReleaseReason = 'read' | 'aborted' | 'failed' | 'expired';

/** The counter a freed hold adds to. */
export function countRelease(stats: WorkerStats, reason: ReleaseReason): void {
  if (reason === 'read') stats.freedByRead++;
  else if (reason === 'aborted') stats.abortedHolds++;
  else if (reason === 'failed') stats.failedPushes++;
  else stats.freedByLease++;
}
