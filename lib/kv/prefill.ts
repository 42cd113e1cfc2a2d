// The prefill side: serve each local (pp, tp) rank's handshake payload, and
// count the decode side's "<request_id>:<n>" notifications to know when a
// request's blocks may be freed. A request holds a lease (v12: 30 s, kept
// alive by the decode side's "HB:id1,id2" heartbeats; v0.13: 480 s) and its
// blocks are freed when the lease runs out without the reads.
import type { NixlAgent } from '../agent';
import { createHandshake } from '../handshake';
import type { WireName, WireProfile } from '../handshake/model';
import type {
  HandshakeLogger,
  HandshakeMethod,
  HandshakeServer,
  HandshakeStrategy,
  TlsServerOptions,
} from '../handshake/types';
import { defaultLogger } from '../handshake/types';
import { encodeAgentMetadata, wireProfile } from '../handshake/wire';
import { DescList } from '../descriptors';
import { ucxErrorMode } from '../ucx';
import { type KvLayout, toAgentMetadata } from './layout';
import { type LeaseBoard, SlotState, registerBoard } from './lease-board';
import { notifsToWaitFor } from './tp';
import { listenNotifs } from './notifs';
import { NixlError } from '../errors';

/** One rank of a prefill engine: its agent, its layout and, optionally, its lease board. */
export interface PrefillRank {
  agent: NixlAgent;
  layout: KvLayout;
  /**
   * This rank's lease board (its PrefillTracker's `board`): nixl-node decodes
   * then confirm every read against it (lease-board.ts). Registered here.
   */
  leaseBoard?: LeaseBoard;
}

/** What servePrefill serves: the ranks, the compatibility hash, where, and in which wire profile. */
export interface ServePrefillOptions {
  ranks: PrefillRank[];
  compatibilityHash: string;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** Default: NIXL_WIRE, else v12. */
  wire?: WireName | WireProfile;
  host?: string;
  port: number;
  dpRank?: number;
  tls?: TlsServerOptions;
  bearerToken?: string;
  logger?: HandshakeLogger;
  /** The clock v12 replies carry, seconds (default performance.now): the one expiry times are on. */
  clock?: () => number;
}

/** Serves the payload of every given rank (call setPayload again after registering more memory). */
export async function servePrefill(o: ServePrefillOptions): Promise<HandshakeServer> {
  const hs = typeof o.handshake === 'object' ? o.handshake : createHandshake(o.handshake);
  const wire = wireProfile(o.wire);
  const payloads = o.ranks.map(({ agent, layout, leaseBoard }) => {
    if (leaseBoard) registerBoard(leaseBoard, agent);
    const md = toAgentMetadata(layout, agent.getAgentMetadata());
    const board = leaseBoard
      ? { nixlNodeLeaseBoard: [DescList.from(leaseBoard.mem).addr(0), BigInt(leaseBoard.slots)] }
      : {};
    const mode = agent.engine === 'nixl' ? ucxErrorMode(agent) : undefined;
    if (mode !== undefined) Object.assign(board, { nixlNodeUcxErrorHandlingMode: mode });
    return {
      ppRank: layout.ppRank ?? 0,
      tpRank: layout.tpRank,
      payload: {
        compatibilityHash: o.compatibilityHash,
        agentMetadataBytes: encodeAgentMetadata({ ...md, ...board }, wire),
      },
    };
  });
  return hs.serve({
    host: o.host,
    port: o.port,
    dpRank: o.dpRank,
    payloads,
    wire,
    tls: o.tls,
    bearerToken: o.bearerToken,
    logger: o.logger,
    clock: o.clock,
  });
}

const KV_NOTIF = /^(.+):(\d+)$/s;
const HEARTBEAT = /^HB:(.*)$/s;

/** A request whose blocks a PrefillTracker released, and why. */
export interface Released {
  requestId: string;
  blockIds: number[];
  /** aborted: released early because no decode will read it (abort()). */
  reason: 'read' | 'expired' | 'aborted';
}

interface Pending {
  blockIds: number[];
  /** False: heartbeats do not extend it (a decode's hold of a finished turn: a fixed TTL, as vLLM's). */
  renewable: boolean;
  since: number; // now() at expect()
  /** now() when the lease runs out. */
  expiry: number;
  timer: NodeJS.Timeout;
  resolve(r: Released): void;
}

/** Options of a PrefillTracker. */
export interface PrefillTrackerOptions {
  agent: NixlAgent;
  /** This prefill engine's TP size. */
  tpSize: number;
  /** How the decode side counts (default: NIXL_WIRE, else v12). */
  wire?: WireName | WireProfile;
  /**
   * Blocks of a request nobody read are freed after this long (vLLM
   * kv_lease_duration: 30 s in v12, extended by heartbeats; 480 s in v0.13).
   */
  leaseMs?: number;
  /** Older name of leaseMs. */
  expireMs?: number;
  /** Monotonic clock in ms (tests pass a fake one). Default performance.now. */
  now?: () => number;
  logger?: HandshakeLogger;
  /**
   * Publish whether each request is still held on this lease board (give the
   * same board to servePrefill), so nixl-node decodes can prove their reads
   * ended in time. vLLM decodes never look at it.
   */
  board?: LeaseBoard;
}

/** How one request is held (PrefillTracker.expect). */
export interface HoldOptions {
  /** This request's lease, ms (default: the tracker's leaseMs). */
  leaseMs?: number;
  /**
   * Whether heartbeats extend it (default true). A decode holding a finished
   * turn for the next turn's prefill (vLLM decoder_kv_blocks_ttl) passes false.
   */
  renewable?: boolean;
}

/** Told of each release and each notification for an untracked request (registerKvMetrics). */
export interface PrefillTrackerSink {
  /** Blocks were released (read, lease expired, or aborted). */
  released(r: Released, heldMs: number): void;
  /** A notification named no request this tracker holds. */
  unrecognized(): void;
  /** A decode reported reading a request whose lease had run out (its blocks may have been reused). */
  lateRead?(requestId: string): void;
}

/** The longest wait a Node.js timer takes. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Holds a prefill's blocks per request until the decode's completion
 * notification, the lease, or an abort; sends heartbeats' extensions through.
 */
export class PrefillTracker {
  readonly sinks = new Set<PrefillTrackerSink>();
  readonly #o: PrefillTrackerOptions;
  readonly #pending = new Map<string, Pending>();
  /** Reads reported before expect() was called, with when they came. */
  readonly #early = new Map<string, { count: number; suffix: number; at: number }>();
  /** Requests whose lease ran out, so that a late read is not taken for a new request of that id. */
  readonly #expired = new Map<string, number>();
  readonly #wire: WireProfile;
  readonly #leaseMs: number;
  readonly #now: () => number;
  readonly #abort = new AbortController();
  #loop: Promise<void> | undefined;
  unrecognized = 0;
  heartbeats = 0;
  /** Reads reported after the request's lease ran out (vLLM: nixl_num_kv_expired_reqs_total). */
  lateReads = 0;

  constructor(o: PrefillTrackerOptions) {
    this.#o = o;
    this.#wire = wireProfile(o.wire);
    this.#leaseMs = o.leaseMs ?? o.expireMs ?? this.#wire.defaultLeaseMs;
    if (!(this.#leaseMs > 0))
      throw new NixlError(`leaseMs must be positive, got ${this.#leaseMs}`, 'NIXL_ERR_INVALID_PARAM');
    this.#now = o.now ?? (() => performance.now());
  }

  /** The lease board it publishes on, if any. */
  get board(): LeaseBoard | undefined {
    return this.#o.board;
  }

  /** When a tracked request's lease runs out, on the tracker's clock (ms); undefined if not tracked. */
  leaseExpiry(requestId: string): number | undefined {
    return this.#pending.get(requestId)?.expiry;
  }

  get pending(): number {
    return this.#pending.size;
  }

  /**
   * A request whose blocks wait for decode reads. Resolves when every decode
   * rank that reads this prefill rank has said so, or when it expires.
   */
  expect(requestId: string, blockIds: number[], hold: HoldOptions = {}): Promise<Released> {
    const leaseMs = hold.leaseMs ?? this.#leaseMs;
    if (!(leaseMs > 0)) throw new NixlError(`leaseMs must be positive, got ${leaseMs}`, 'NIXL_ERR_INVALID_PARAM');
    if (this.#pending.has(requestId))
      throw new NixlError(`request '${requestId}' is already tracked`, 'NIXL_ERR_INVALID_PARAM');
    this.#start();
    this.#expired.delete(requestId);
    return new Promise<Released>((resolve) => {
      const now = this.#now();
      // Where a decode checks that the blocks are still held (no free slot: its reads fail closed).
      this.#o.board?.hold(requestId);
      const p: Pending = {
        blockIds,
        renewable: hold.renewable ?? true,
        since: now,
        expiry: now + leaseMs,
        timer: undefined as never,
        resolve,
      };
      this.#pending.set(requestId, p);
      this.#arm(requestId, p);
      const e = this.#early.get(requestId);
      if (e && e.count >= notifsToWaitFor(this.#wire, e.suffix, this.#o.tpSize)) {
        this.#early.delete(requestId);
        this.#finish(requestId, 'read');
      }
    });
  }

  #arm(requestId: string, p: Pending): void {
    clearTimeout(p.timer);
    p.timer = setTimeout(
      () => {
        if (this.#pending.get(requestId) !== p) return;
        if (this.#now() >= p.expiry) this.#finish(requestId, 'expired');
        else this.#arm(requestId, p);
      },
      // A Node.js timer waits at most 2^31 - 1 ms (a longer wait fires at once, and would re-arm every ms).
      Math.min(MAX_TIMER_MS, Math.max(0, p.expiry - this.#now())),
    );
  }

  #start(): void {
    this.#loop ??= listenNotifs(
      this.#o.agent,
      (x) => isTrackerNotif(x.msg.toString('utf8')),
      (n) => this.#onNotif(n.msg.toString('utf8')),
      this.#abort.signal,
    );
  }

  #onNotif(msg: string): void {
    const hb = HEARTBEAT.exec(msg);
    if (hb) {
      this.#onHeartbeat(hb[1].split(','));
      return;
    }
    const m = KV_NOTIF.exec(msg)!;
    const [requestId, suffix] = [m[1], Number(m[2])];
    const now = this.#now();
    const log = this.#o.logger ?? defaultLogger;
    if (this.#expired.has(requestId)) {
      this.lateReads++;
      for (const s of this.sinks) s.lateRead?.(requestId);
      log.warn(`read of request '${requestId}' came after its lease ran out; its blocks may have been reused`);
      return;
    }
    const e = this.#early.get(requestId) ?? { count: 0, suffix, at: now };
    e.count++;
    if (this.#pending.has(requestId)) {
      if (e.count >= notifsToWaitFor(this.#wire, suffix, this.#o.tpSize)) {
        this.#early.delete(requestId);
        this.#finish(requestId, 'read');
      } else {
        this.#early.set(requestId, e);
      }
      return;
    }
    this.unrecognized++;
    for (const s of this.sinks) s.unrecognized();
    log.warn(`notification for request '${requestId}' that is not (yet) tracked`);
    this.#early.set(requestId, e);
    // Forget stale early reports.
    for (const [k, v] of this.#early) if (now - v.at > this.#leaseMs) this.#early.delete(k);
  }

  /** vLLM's _handle_heartbeat: each listed pending request's lease becomes max(old, now + 2/3 lease). */
  #onHeartbeat(ids: string[]): void {
    this.heartbeats++;
    const until = this.#now() + Math.floor((this.#leaseMs * 2) / 3);
    for (const id of ids) {
      const p = this.#pending.get(id);
      if (p?.renewable && until > p.expiry) p.expiry = until;
    }
  }

  #finish(requestId: string, reason: Released['reason']): void {
    const p = this.#pending.get(requestId);
    if (!p) return;
    this.#pending.delete(requestId);
    clearTimeout(p.timer);
    // On the board before anything can reuse the blocks (the resolve below gives them back).
    this.#o.board?.release(
      requestId,
      reason === 'read' ? SlotState.READ : reason === 'expired' ? SlotState.EXPIRED : SlotState.ABORTED,
    );
    if (reason !== 'read') {
      // A read that still comes is late: its blocks may have been reused.
      this.#expired.set(requestId, this.#now());
      for (const [k, at] of this.#expired) if (this.#now() - at > 10 * this.#leaseMs) this.#expired.delete(k);
    }
    const r: Released = { requestId, blockIds: p.blockIds, reason };
    for (const s of this.sinks) s.released(r, this.#now() - p.since);
    p.resolve(r);
  }

  /** Frees a tracked request now, as read (say, its decode ran on this engine and read the blocks in place). */
  release(requestId: string): boolean {
    if (!this.#pending.has(requestId)) return false;
    this.#finish(requestId, 'read');
    return true;
  }

  /**
   * Frees a tracked request now because no decode will read it (it failed, or
   * its client went away); a read reported after this counts as late.
   */
  abort(requestId: string): boolean {
    if (!this.#pending.has(requestId)) return false;
    this.#finish(requestId, 'aborted');
    return true;
  }

  /** Stops listening; pending requests are released as expired. */
  async close(): Promise<void> {
    this.#abort.abort();
    await this.#loop;
    for (const id of [...this.#pending.keys()]) this.#finish(id, 'expired');
  }
}

function isTrackerNotif(msg: string): boolean {
  return HEARTBEAT.test(msg) || KV_NOTIF.test(msg);
}
