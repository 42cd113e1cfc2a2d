// The handshake strategy interface: a prefill engine serves the
// NixlHandshakePayload of each of its (pp_rank, tp_rank); a decode worker
// fetches the ranks it needs. ZMQ (zmq.ts) and HTTP/S (http.ts) implement
// it, in either wire profile; index.ts picks one.
import type { HandshakePayload } from './payload';
import type { NixlAgentMetadata, WireName, WireProfile } from './model';
import { NixlError } from '../errors';

/** The side channel's transport: vLLM's ZeroMQ one, or HTTP(S). */
export type HandshakeMethod = 'zmq' | 'http';

/** Where handshake warnings go. */
export interface HandshakeLogger {
  /** Reports a warning. */
  warn(message: string): void;
}

/** Writes warnings to stderr. */
export const defaultLogger: HandshakeLogger = {
  warn: (m) => process.stderr.write(`nixl-node handshake: ${m}\n`),
};

/** TLS of an HTTPS side channel server. */
export interface TlsServerOptions {
  cert: string | Buffer;
  key: string | Buffer;
  /** CA that client certificates must chain to; with it, clients must present one. */
  clientCa?: string | Buffer;
}

/** TLS of an HTTPS side channel client. */
export interface TlsClientOptions {
  /** CA for the server certificate (e.g. a self-signed one). */
  ca?: string | Buffer;
  /** Client certificate, when the server checks one. */
  cert?: string | Buffer;
  key?: string | Buffer;
  servername?: string;
}

/** What a side channel serves, and where. */
export interface ServeOptions {
  /** Interface to bind. Default 127.0.0.1; 0.0.0.0 only when given here. */
  host?: string;
  /** Base port; ZMQ binds port + dpRank. 0 = any free port. */
  port: number;
  dpRank?: number;
  /** tp_rank -> payload (pipeline rank 0), or every (pp_rank, tp_rank) served. */
  payloads: Map<number, HandshakePayload> | RankPayload[];
  /** Wire profile (metadata in the payloads must be encoded with it). Default: NIXL_WIRE, else v12. */
  wire?: WireName | WireProfile;
  /** The clock sent with v12 replies, seconds. Default: this process's monotonic clock. */
  clock?: () => number;
  /** Rank answered to the bare b"get_meta_msg" of the per-rank-port form (ZMQ). Default 0. */
  defaultTpRank?: number;
  /** Largest request accepted, bytes. Default 4096. */
  maxRequestBytes?: number;
  logger?: HandshakeLogger;
  /** HTTP only. */
  tls?: TlsServerOptions;
  /** HTTP only: require `Authorization: Bearer <token>`. */
  bearerToken?: string;
}

/** The handshake payload of one (pipeline, tensor-parallel) rank. */
export interface RankPayload {
  ppRank: number;
  tpRank: number;
  payload: HandshakePayload;
}

/** Seconds on this process's monotonic clock (what v12 replies carry). */
export const monotonicSeconds = (): number => performance.now() / 1000;

/** The key of a rank in maps of payloads. */
export function rankKey(ppRank: number, tpRank: number): string {
  return `${ppRank}:${tpRank}`;
}

/** Payloads given as a map of tp ranks or a list, as a list. */
export function payloadList(p: ServeOptions['payloads']): RankPayload[] {
  return Array.isArray(p) ? p : [...p].map(([tpRank, payload]) => ({ ppRank: 0, tpRank, payload }));
}

/** A running side channel. */
export interface HandshakeServer {
  readonly method: HandshakeMethod;
  readonly wire: WireProfile;
  readonly host: string;
  /** The port clients use (for ZMQ: base port + dpRank, or the ephemeral one). */
  readonly port: number;
  /** The base port to advertise (kv_transfer_params remote_port). */
  readonly basePort: number;
  readonly dpRank: number;
  /** Requests answered and requests refused so far. */
  readonly stats: { served: number; refused: number };
  /** Replaces the payload a rank serves (after registering more memory, say). */
  setPayload(tpRank: number, payload: HandshakePayload, ppRank?: number): void;
  /** Stops serving. */
  close(): Promise<void>;
}

/** Where to fetch a rank's payload from, and how long to try. */
export interface FetchOptions {
  host: string;
  /** The server's base port (as advertised). */
  port: number;
  dpRank?: number;
  tpRank: number;
  /** Pipeline rank (v12 only). Default 0. */
  ppRank?: number;
  /** Wire profile. Default: NIXL_WIRE, else v12. */
  wire?: WireName | WireProfile;
  /** Per attempt. Default from NIXL_HANDSHAKE_TIMEOUT (seconds), else 5 s. */
  timeoutMs?: number;
  /** Attempts after the first. Default 2. */
  retries?: number;
  /** Local compatibility hash; undefined skips the check. */
  expectedHash?: string;
  /** Largest answer accepted, bytes. Default 64 MiB. */
  maxResponseBytes?: number;
  signal?: AbortSignal;
  /** HTTP only. */
  tls?: TlsClientOptions;
  bearerToken?: string;
}

/** A fetched payload: the peer's compatibility hash and agent metadata. */
export interface FetchResult {
  compatibilityHash: string;
  metadata: NixlAgentMetadata;
  /** Round trip of the successful attempt, ms. */
  rttMs: number;
  wire: WireName;
  /** v12: the server's clock at its reply, seconds. */
  remoteSeconds?: number;
  /** v12: remote clock - local clock (monotonicSeconds), seconds, from this round trip's midpoint. */
  clockOffsetS?: number;
}

/** A side-channel transport: serve payloads, fetch them. */
export interface HandshakeStrategy {
  readonly method: HandshakeMethod;
  /** Serves payloads. */
  serve(opts: ServeOptions): Promise<HandshakeServer>;
  /** Fetches one rank's payload. */
  fetch(opts: FetchOptions): Promise<FetchResult>;
  /** Releases pooled connections (HTTP keep-alive). */
  close(): void;
}

/** Largest side-channel request served, bytes. */
export const DEFAULT_MAX_REQUEST = 4096;
/** Largest side-channel answer read, bytes. */
export const DEFAULT_MAX_RESPONSE = 64 << 20;

/** The longest a timer waits (2^31 - 1 ms, ~24.8 days); Node fires a longer one after 1 ms. */
const TIMER_MAX_MS = 2 ** 31 - 1;

/** The handshake timeout: NIXL_HANDSHAKE_TIMEOUT (seconds), else 5 s. */
export function defaultTimeoutMs(): number {
  const s = process.env.NIXL_HANDSHAKE_TIMEOUT;
  if (s !== undefined && s !== '') {
    const v = Number(s);
    if (Number.isFinite(v) && v > 0) return Math.min(v * 1000, TIMER_MAX_MS);
  }
  return 5000;
}

/**
 * A fetch's timeout per attempt (`timeoutMs`, else the default): a positive
 * number of ms, at most what a timer holds; else NIXL_ERR_INVALID_PARAM (0,
 * a negative or NaN would fire at once or, for ZeroMQ, wait for ever).
 */
export function fetchTimeoutMs(timeoutMs: number | undefined): number {
  if (timeoutMs === undefined) return defaultTimeoutMs();
  if (typeof timeoutMs !== 'number' || !Number.isFinite(timeoutMs) || timeoutMs <= 0)
    throw new NixlError(
      `timeoutMs must be a positive finite number of milliseconds, got ${timeoutMs}`,
      'NIXL_ERR_INVALID_PARAM',
    );
  return Math.min(timeoutMs, TIMER_MAX_MS);
}

/** A fetch's largest answer (`maxResponseBytes`, else 64 MiB): a positive integer, else NIXL_ERR_INVALID_PARAM (NaN compared as no limit at all). */
export function fetchMaxResponseBytes(bytes: number | undefined): number {
  if (bytes === undefined) return DEFAULT_MAX_RESPONSE;
  if (!Number.isSafeInteger(bytes) || bytes <= 0)
    throw new NixlError(`maxResponseBytes must be a positive integer, got ${bytes}`, 'NIXL_ERR_INVALID_PARAM');
  return bytes;
}

/** A rank number: an integer in 0..65535, or NIXL_ERR_INVALID_PARAM naming it. */
export function checkRank(name: string, v: number | undefined): number {
  const r = v ?? 0;
  if (!Number.isInteger(r) || r < 0 || r > 65535)
    throw new NixlError(`${name} must be an integer in 0..65535, got ${v}`, 'NIXL_ERR_INVALID_PARAM');
  return r;
}
