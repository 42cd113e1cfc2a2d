// What push mode's two sides are asked and answer: the public shapes of
// KvPushReceiver (decode) and KvPushSender (prefill).
import type { NixlAgent } from '../../agent';
import { NixlError } from '../../errors';
import type { WireName, WireProfile } from '../../handshake/model';
import type { HandshakeLogger, HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../../handshake/types';
import type { TraceContext } from '../../tracing';
import type { KvLayout } from '../layout';
import type { KvPeers } from '../peers';
import type { KvStats } from '../stats';
import type { PullLimits } from '../limits';
import type { PushRegLimits } from './reg';

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

/** Options of a KvPushReceiver. */
export interface KvPushReceiverOptions {
  agent: NixlAgent;
  /** This decode rank's KV cache (its engineId is the decode_engine_id prefills check). */
  layout: KvLayout;
  /** Where prefills reach this decode's side channel (PUSH_REG decode_host / decode_port). */
  decodeHost: string;
  decodePort: number;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** The agent's connections, shared with its other KV roles (as KvPullerOptions.peers). */
  peers?: KvPeers;
  /** Default: NIXL_WIRE, else v12 (push needs v12). */
  wire?: WireName | WireProfile;
  /** The push compatibility hash (transferMode 'push'); undefined skips the check. */
  expectedHash?: string;
  /** The prefill's kv_lease_duration: heartbeats every sixth of it, and the quarantine's base. Default 30 s. */
  kvLeaseMs?: number;
  /** Default deadline of a receive, ms. Default 120 s. */
  timeoutMs?: number;
  /** How long a block given up on stays out of use. Default kvLeaseMs + 5 s. */
  quarantineMs?: number;
  /** Sign registrations with this KV secret (the prefill must hold the same one). */
  secret?: string | Buffer;
  limits?: PullLimits;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
}

/** Options of a KvPushSender. */
export interface KvPushSenderOptions {
  agent: NixlAgent;
  /** This prefill rank's KV cache (its engineId is what registrations must name). */
  layout: KvLayout;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** Default: NIXL_WIRE, else v12 (push needs v12). */
  wire?: WireName | WireProfile;
  /** The push compatibility hash: a decode answering another is refused. Undefined skips the check. */
  expectedHash?: string;
  /** The agent's connections, shared with its other KV roles (as KvPullerOptions.peers). */
  peers?: KvPeers;
  /** kv_lease_duration: blocks of an offered request are held at most this long (heartbeats extend). Default 30 s. */
  leaseMs?: number;
  /** No WRITE is posted closer than this to the lease end or the decode's deadline. Default 50 ms. */
  marginMs?: number;
  /** Require registrations signed with this KV secret. */
  secret?: string | Buffer;
  regLimits?: PushRegLimits;
  /**
   * Registrations kept waiting for their request (one that came before the
   * request's offer). Default 4096. When a bound below is reached the
   * heaviest sender's oldest make room, each refused to its sender
   * (docs/kv-push.md, "Registrations waiting").
   */
  maxPendingRegistrations?: number;
  /** What those may cost in all, bytes (1 KiB + 16 bytes a block id each). Default 64 MiB. */
  maxPendingRegistrationBytes?: number;
  /** How many one sending agent (a decode rank) may keep waiting; the same share of the bytes. Default 1/4 of the store. */
  maxPendingRegistrationsPerAgent?: number;
  /** How many may name one decode engine; the same share of the bytes. Default 1/2 of the store. */
  maxPendingRegistrationsPerEngine?: number;
  /** How long an unpaired registration is kept. Default 480 s (vLLM's decoder_kv_blocks_ttl). */
  registrationTtlMs?: number;
  limits?: PullLimits;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
  logger?: HandshakeLogger;
  /**
   * Where each WRITE is counted (post and transfer time, bytes, descriptors,
   * failures): vLLM's push prefill records its WRITEs in its NIXL transfer
   * stats (the vllm:nixl_* series), the side that posts a transfer records it.
   */
  transferStats?: KvStats;
}

/** How an offered request ended: written, lease over, aborted, or its push failed (not retried). */
export interface PushSent {
  requestId: string;
  blockIds: number[];
  reason: 'written' | 'expired' | 'aborted' | 'failed';
  /** The decode request written to, once paired. */
  decodeRequestId?: string;
  bytes: number;
  /** WRITEs posted. */
  writes: number;
  /** Why it failed (reason 'failed'). */
  error?: NixlError;
}

/** Counters of a KvPushSender. */
export interface PushSenderStats {
  registrations: number;
  /** Registrations not kept: malformed, forged, not for this engine, or alone over a sender's byte share. */
  refused: number;
  /** Registrations given up while waiting, to keep the quotas (the heaviest sender's oldest first). */
  evicted: number;
  /** NIXL_NODE_PUSH_REFUSED notifications sent, and those that could not be (decode unreachable, too many at once). */
  refusalsSent: number;
  refusalsLost: number;
  duplicates: number;
  /** Registrations whose blocks disagree with another rank's of the same request (that rank not written). */
  mismatched: number;
  written: number;
  failed: number;
  expired: number;
  bytes: number;
  heartbeats: number;
}
