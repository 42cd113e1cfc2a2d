// What a pull is asked and what it answers: the public shapes of KvPuller.
import type { NixlAgent } from '../../agent';
import { NixlError } from '../../errors';
import type { WireName, WireProfile } from '../../handshake/model';
import type { HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../../handshake/types';
import type { TraceContext } from '../../tracing';
import type { KvLayout } from '../layout';
import type { KvPeers } from '../peers';
import type { RemoteLease } from '../leases';
import type { PullLimits } from '../limits';
import type { HandshakeBudget } from '../connect-wait';
import type { RemoteEndpoint } from '../remote-engines';

export type { HandshakeBudget } from '../connect-wait';

/**
 * Why a pull failed. `expired`: the prefill's lease on the blocks ran out (or
 * would have) before the read could be proven complete, so the bytes may be
 * another request's: never trusted.
 */
export type PullFailure = 'handshake' | 'setup' | 'transfer' | 'timeout' | 'peer-gone' | 'aborted' | 'expired';

/** A failed pull: the local blocks named here hold no valid KV and must be recomputed. */
export class PullError extends NixlError {
  constructor(
    message: string,
    code: string,
    readonly kind: PullFailure,
    readonly requestId: string,
    readonly localBlockIds: number[],
    cause?: unknown,
  ) {
    super(message, code, undefined, { cause });
    this.name = 'PullError';
  }
}

/**
 * The PullError for a pull of `requestId` that failed as `kind` because of
 * `e` (a PullError already is one).
 * @internal
 */
export function pullError(kind: PullFailure, e: unknown, requestId: string, localBlockIds: number[]): PullError {
  if (e instanceof PullError) return e;
  const err = e as NixlError;
  return new PullError(
    `pull of request '${requestId}' failed (${kind}): ${err?.message ?? e}`,
    err?.code ?? 'NIXL_ERR_UNKNOWN',
    kind,
    requestId,
    localBlockIds,
    e,
  );
}

/** One pull: from whom, which remote blocks into which local blocks, and how long to try. */
export interface PullOptions {
  remote: RemoteEndpoint;
  localBlockIds: ArrayLike<number>;
  remoteBlockIds: ArrayLike<number>;
  /** The prefill side's request id (vLLM remote_request_id): notifications carry it. */
  requestId: string;
  timeoutMs?: number;
  signal?: AbortSignal;
  /** Merge runs of adjacent blocks into larger descriptors. Default: the puller's setting. */
  coalesce?: boolean;
  /** remoteBlockIds are logical ids, expanded by the prefill's physical_blocks_per_logical_kv_block. */
  remoteIdsAreLogical?: boolean;
  /**
   * Which remote blocks fill fewer local ones: 'tail' (default, vLLM's: the
   * uncached suffix of a partial prefix hit) or 'head' (the first: the prefix
   * of a conversation a decode holds for its next turn).
   */
  remoteRange?: 'head' | 'tail';
  /**
   * Until when the prefill holds the blocks. Without it the pull trusts the
   * blocks whenever it reads them (pullFromParams always gives one).
   */
  lease?: RemoteLease;
  /** The span this pull's span is a child of (tracing.ts); default: the active context. */
  traceContext?: TraceContext;
  /**
   * How long this pull waits to connect to the remote engine (default: the
   * puller's handshakeTimeoutMs per attempt, 3 attempts). A connect this pull
   * starts tries with this budget; one already under way is waited for at
   * most this long. For reads that are only an optimisation (a previous
   * turn's KV, recomputed when it cannot be read).
   */
  handshake?: HandshakeBudget;
}

/** What a pull moved. */
export interface PullResult {
  requestId: string;
  bytes: number;
  descriptors: number;
  postMs: number;
  transferMs: number;
  remoteRanks: number[];
  coalesced: boolean;
}

/** Options of KvPuller.pullFromParams. */
export interface PullFromParamsOptions {
  /** Our logical block ids (one KV-cache group), expanded by layout.physicalBlocksPerLogical. */
  localBlockIds: ArrayLike<number>;
  timeoutMs?: number;
  signal?: AbortSignal;
  coalesce?: boolean;
  /** The span this pull's span is a child of (tracing.ts); default: the active context. */
  traceContext?: TraceContext;
  /**
   * When the prefill answered with these params (performance.now(), ms):
   * where its lease starts when the params carry no expiry time. Default:
   * now, which is later than the truth; pass it when the wait was long.
   */
  issuedAtMs?: number;
  /**
   * The params are a decode's hold of a finished turn (bidirectional KV):
   * read the first remote blocks (as many as localBlockIds) and send no
   * heartbeats (that hold is a fixed TTL that heartbeats do not extend).
   */
  continuation?: boolean;
  /** This pull's handshake budget (PullOptions.handshake). */
  handshake?: HandshakeBudget;
}

/** Options of a KvPuller. */
export interface KvPullerOptions {
  agent: NixlAgent;
  layout: KvLayout;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** Default: NIXL_WIRE, else v12. */
  wire?: WireName | WireProfile;
  /** The prefill's kv_lease_duration (v12): heartbeats go every sixth of it. Default 30 s. */
  kvLeaseMs?: number;
  /** Local compatibility hash; undefined skips the check. */
  expectedHash?: string;
  /**
   * The agent's connections, shared with its other KV roles (peers.ts). Its
   * handshake, wire, limits, handshakeTimeoutMs, tls and bearerToken are the
   * ones connects use then; the caller closes it after the puller.
   */
  peers?: KvPeers;
  /**
   * Pulls in flight at once to one remote engine (the rest queue for that
   * engine only, so a stalled prefill cannot hold up pulls from others).
   * Default 16.
   */
  maxConcurrent?: number;
  /** Bounds on what a peer or a request may size (limits.ts). */
  limits?: PullLimits;
  /**
   * Confirm every read against the lease board of a nixl-node prefill that
   * has one (lease-board.ts): one small READ after the KV, before the
   * completion notification. Default true; vLLM prefills have none.
   */
  leaseBoards?: boolean;
  /**
   * Extra margin (ms) a pull must keep before the prefill's lease runs out,
   * on top of half the best handshake round trip (the clock uncertainty).
   * Default 50.
   */
  leaseSlackMs?: number;
  /**
   * Merge runs of adjacent blocks into larger descriptors. Default false: on
   * the loopback engine it measured 0.8-1.0x of per-block prepped transfers
   * (npm run bench), and NIXL merges consecutive descriptors of a prepped
   * request itself; turn it on for backends with a high per-descriptor cost.
   */
  coalesce?: boolean;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
  /**
   * Require kv_transfer_params signed with this secret (params-auth.ts):
   * pullFromParams refuses unsigned or forged ones before reading anything.
   */
  paramsSecret?: string | Buffer;
}
