// The Agent API's types: options, states, and the handles its calls return.
// Handles are plain records of the addon's ids: the agent holds the state.
import type { DescList, MemType } from '../descriptors';

/** Which engine an agent runs on: NIXL, or the in-process loopback engine. */
export type EngineKind = 'loopback' | 'nixl';
/** A transfer's direction: READ pulls remote memory into local, WRITE pushes local into remote. */
export type XferOp = 'READ' | 'WRITE';
/** A transfer's state, as NIXL reports it: in progress, done, or failed. */
export type XferState = 'PROC' | 'DONE' | 'ERR';
/** A notification message: text, or bytes. */
export type NotifMsg = string | Uint8Array;

/** Options of a new NixlAgent (NIXL's nixlAgentConfig, and the engine). */
export interface AgentOptions {
  /** Default: 'nixl' when compiled in, else 'loopback' (env NIXL_NODE_ENGINE overrides). */
  engine?: EngineKind;
  /** Backends created at start. Default: ['UCX'] on nixl, ['LOOPBACK'] on loopback. */
  backends?: string[];
  /** Parameters per backend created at start, e.g. { UCX: { ucx_error_handling_mode: 'none' } }. */
  backendParams?: Record<string, Record<string, string>>;
  /** NIXL's own progress thread (nixl engine). Default true. */
  progressThread?: boolean;
  /** NIXL pthrDelay in microseconds; 0 spins a core. Default 1000. */
  progressDelayUs?: number;
  /** Needed for getXferTelemetry, as in NIXL. */
  captureTelemetry?: boolean;
  /** NIXL's own metadata listener port (nixl engine; 0 = off). */
  listenPort?: number;
  /** @internal Tests: the loopback worker waits this long before each transfer. */
  testDelayUs?: number;
  /** @internal Tests: the first handle the engine hands out, to reach the counter's limits. */
  testFirstHandle?: number;
  /**
   * Transfers of at most this many bytes are posted on the calling thread,
   * as NIXL's Python API posts: a copy this small costs less than the hop to
   * the engine's thread and the completion's way back, and one that finishes
   * inside the post (UCX's cma on one host, the loopback engine) is DONE when
   * transfer() returns, with no event to wait for. Larger transfers go through
   * the engine's thread, so a long copy never blocks the event loop. Only a
   * transfer with nothing posted before it still queued is posted inline (no
   * transfer or notification overtakes another). 0 posts every transfer from
   * the engine's thread. Default 1 MiB on both engines. Inline
   * work (posts and the settling of waits they finished) runs for at most
   * 1 ms per turn of the event loop: past that, posts go through the
   * engine's thread until the loop has turned.
   */
  inlinePostMaxBytes?: number;
  /**
   * A transfer larger than inlinePostMaxBytes is also posted on the calling
   * thread when its previous post took at most this many microseconds: what
   * holds the event loop is how long a post takes, not its size. A one-host
   * copy of a few MiB (UCX's cma, the loopback engine) takes a few hundred
   * microseconds where the hop to the engine's thread and back costs tens;
   * a post that hands the work to a NIC returns in microseconds whatever its
   * size. A READ's first post, not yet timed, is predicted from the last
   * timed post to the same remote agent (its time scaled by the larger of the
   * bytes and descriptor ratios) and goes inline when that is at most this.
   * It goes through the engine's thread with no timed post to that agent yet,
   * more bytes than that post had, local pages not all resident (a copy into
   * pages never touched faults each in, which no sample measured), or more
   * than 16 separate local ranges to check; so does every WRITE's first post
   * (the peer's pages cannot be checked). Every post of a larger request is
   * timed again (and replaces its agent's sample), so one that slows down (a
   * loaded machine) goes back there. 0: only the size rule. Default 500.
   */
  inlinePostMaxUs?: number;
}

/** @internal The default of AgentOptions.inlinePostMaxBytes. */
export const DEFAULT_INLINE_POST_MAX_BYTES = 1 << 20;
/** @internal The default of AgentOptions.inlinePostMaxUs. */
export const DEFAULT_INLINE_POST_MAX_US = 500;

/** How long a wait may take, and what cancels it. */
export interface WaitOptions {
  timeoutMs?: number;
  signal?: AbortSignal;
}

/** Options of a one-shot read or write. */
export interface XferOptions extends WaitOptions {
  notifMsg?: NotifMsg;
  memType?: MemType;
  remoteMemType?: MemType;
}

/** A backend's parameters (name -> value) and the memory types it handles. */
export interface BackendParams {
  params: Record<string, string>;
  memTypes: string[];
}

/** A notification received from a peer agent. */
export interface Notif {
  agent: string;
  msg: Buffer;
}

/** Memory registered with an agent; pass back to deregisterMemory. */
export class RegisteredMemory {
  constructor(
    readonly id: number,
    readonly descs: DescList,
  ) {}
}

/** A prepared descriptor list (prepXferDlist). */
export class DlistHandle {
  constructor(
    readonly id: number,
    readonly agent: string,
    readonly length: number,
  ) {}
}

/** A transfer request (initializeXfer / makePreppedXfer). */
export class XferHandle {
  constructor(
    readonly id: number,
    readonly remoteAgent: string,
    /** @internal The bytes the request moves, -1 if the engine cannot tell (the inline budget's clock). */
    readonly bytes = -1,
  ) {}
}
