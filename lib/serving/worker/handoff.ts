// How KV moves between a prefill and its decode, as a strategy the worker
// picks once at start (vLLM's push connector picks its scheduler and worker
// classes once): pull (handoff-pull.ts: the decode reads, vLLM
// NixlConnector) or push (handoff-push.ts: the prefill writes, vLLM
// NixlPushConnector). The roles (prefill.ts, decode.ts) call a KvRoute and
// never ask which mode it is.
import type { NixlAgent } from '../../agent';
import type { KvTransferParams, WireName } from '../../handshake/model';
import type { HandshakeServer } from '../../handshake/types';
import type { KvLayout } from '../../kv/layout';
import type { KvPeers } from '../../kv/peers';
import type { PrefillTracker } from '../../kv/prefill';
import type { KvPuller } from '../../kv/pull/puller';
import type { SpanLike } from '../../tracing';
import type { GenerationRequest, KvBinding, PrefilledKv, ServingModel } from '../models/types';
import type { Taken } from './block-store';
import type { Hold, HoldKeeper } from './holds';
import type { WorkerStats } from './stats';
import type { TestHooks } from './test-hooks';

/** How a worker moves KV: the decode reads it (pull) or the prefill writes it (push). */
export type KvMode = 'pull' | 'push';

/** What a decode's KV came with once it is in its blocks. */
export interface Fetched {
  /** The request the state must be of (a state made for another is refused). */
  binding: KvBinding;
  /** Time it took to arrive, ms. */
  ms: number;
  /** The answer's nixl_node fields of the move (kv_mode, kv_pull_ms or kv_push_ms). */
  info: Record<string, unknown>;
}

export interface FetchContext {
  signal: AbortSignal;
  span: SpanLike;
  /** When the request arrived (performance.now): a lease is judged from it. */
  arrivedMs: number;
}

/** A decode's kv_transfer_params, parsed and checked once: how many blocks, then how the KV comes into them. */
export interface DecodePlan {
  readonly blocks: number;
  fetch(blocks: Taken, ctx: FetchContext): Promise<Fetched>;
}

/** One KV mode's prefill and decode sides. */
export interface KvRoute extends HoldKeeper {
  /** Prefill: refuses, before any compute, a prompt its decode would refuse. */
  checkPrefill(req: GenerationRequest): void;
  /** Prefill: the id its blocks are held under (never made of what the client sent but a checked transfer id). */
  holdId(kvp: Record<string, unknown>): string;
  /** Prefill: refuses KV this mode cannot hand over. */
  checkKv(kv: PrefilledKv): void;
  /** Prefill: the request its state is bound to. */
  binding(holdId: string, ids: number[]): KvBinding;
  /** Prefill: hands the held blocks over (settles the hold when they are read, written, aborted or expire). */
  offer(hold: Hold, kv: PrefilledKv, signal: AbortSignal): Promise<void>;
  /** Prefill: the kv_transfer_params it answers with (unsigned). */
  params(o: { id: string; ids: number[]; tokens: number }): Record<string, unknown>;
  /** Decode: parses and checks kv_transfer_params once. Throws HttpError. */
  plan(kvp: Record<string, unknown>, req: GenerationRequest, known: number | undefined): DecodePlan;
}

/**
 * What every mode keeps of pull: the tracker (held turns, the side channel's
 * board; it keeps the holds it tracks) and the puller (turns).
 */
export interface PullSide extends HoldKeeper {
  readonly tracker: PrefillTracker;
  readonly puller: KvPuller;
  /** The side channel, once started: where params say a decode (or the next turn's prefill) handshakes. */
  readonly side?: HandshakeServer;
  /** Params as the prefill sent them, verified (with a secret) and parsed: a 400 when they are not. */
  parse(kvp: Record<string, unknown>): KvTransferParams;
}

/** Where the side channel listens. */
export interface SideChannelOptions {
  host: string;
  /** 0: any free port. */
  port: number;
  /** Its compatibility hash (default: the model's): a peer of another mode or model is refused at the handshake. */
  hash?: string;
}

/** A worker's KV mode, picked once. */
export interface KvHandoff {
  readonly pull: PullSide;
  /** Serves the side channel (peers handshake there) and what moves KV through it. */
  start(o: SideChannelOptions): Promise<void>;
  /** The route of one request's kv_transfer_params. Throws HttpError (kv_mode_mismatch). */
  pick(kvp: Record<string, unknown> | undefined): KvRoute;
  /** What /health says of it (a push proxy reads where a prefill's KV is). */
  health(): Record<string, unknown>;
  close(): Promise<void>;
}

/** What a worker's KV mode is made of. */
export interface HandoffOptions {
  /** The worker's (and its engine's) name. */
  name: string;
  agent: NixlAgent;
  layout: KvLayout;
  /** The agent's connections, shared by every KV role of the worker (one handshake and agent load per peer). */
  peers: KvPeers;
  model: ServingModel;
  stats: WorkerStats;
  wire?: WireName;
  leaseMs?: number;
  secret?: string;
  /** This worker's monotonic clock, ms. */
  now: () => number;
  hooks: TestHooks;
  /** Push: a decode's deadline for every WRITE, ms. */
  pushTimeoutMs?: number;
}

/** Pull, as every mode has it (push sends a request whose params say pull its way). */
export type PullMode = KvHandoff & KvRoute & PullSide;

/** The request kv_transfer_params name: a state made for another is refused. */
export function bindingOf(p: KvTransferParams): KvBinding {
  return { engineId: p.remoteEngineId, requestId: p.remoteRequestId, blockIds: p.remoteBlockIds[0] ?? [] };
}
