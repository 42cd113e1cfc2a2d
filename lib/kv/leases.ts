// Lease keeping on the decode side: while a request waits here, heartbeats
// keep the prefill's lease on its blocks (v12: "HB:id1,id2" to every rank of
// the engine, every sixth of the lease), and a request's deadline on our
// clock is its expiry time mapped through the handshake's clock offset,
// moved later by each heartbeat every rank took. Both pull and push decodes
// hold leases this way (vLLM heartbeats alike in both modes).
import type { WireProfile } from '../handshake/model';

/** What the prefill promised about how long it holds a request's blocks. */
export interface RemoteLease {
  /** v12 remote_blocks_expiry_time: the prefill's monotonic clock, seconds (mapped with the handshake's offset). */
  remoteExpiryS?: number | null;
  /** When the prefill answered, on this process's performance.now() (ms): the lease runs from there otherwise. */
  issuedAtMs: number;
  /** The lease length when no expiry time is given (the profile's), and what a heartbeat extends by 2/3 of. */
  leaseMs: number;
}

/** What lease keeping needs of a connected remote engine. @internal */
export interface LeasedEngine {
  readonly key: string;
  readonly dropped: boolean;
  /** v12: prefill clock - our clock, seconds, from the lowest-RTT handshake sample. */
  readonly clockOffsetS: number | undefined;
  /** The lowest handshake round trip, ms: half of it bounds the clock offset's error. */
  readonly bestRttMs: number;
  /** The remote agents a heartbeat goes to (every rank). */
  agentNames(): Iterable<string>;
}

/** When the prefill may free a request's blocks on our clock (ms), and the margin a read must keep from it. */
export interface LeaseWindow {
  deadlineMs: number;
  marginMs: number;
}

/** @internal */
export interface LeaseKeeperOptions<E, K> {
  wire: WireProfile;
  /** The prefill's kv_lease_duration: heartbeats go every sixth of it. Default 30 s. */
  kvLeaseMs?: number;
  /** Extra margin (ms) before the lease end. Default 50. */
  leaseSlackMs?: number;
  /** The engine key of an endpoint (one heartbeat timer per key). */
  keyOf: (ep: E) => string;
  /** The connected engine of an endpoint (heartbeats handshake first, as vLLM's do). */
  engineFor: (ep: E) => Promise<K>;
  /** Sends a notification; false when it could not be sent. */
  notify: (agentName: string, msg: string) => boolean;
  /** Told of each heartbeat: the ids it named, and whether every rank took it. */
  onHeartbeat?: (ids: readonly string[], delivered: boolean) => void;
}

interface Held<E> {
  ep: E;
  /** Remote request id -> holders. */
  ids: Map<string, number>;
  /** Remote request id -> when the last heartbeat every rank took was sent (performance.now()). */
  lastSentMs: Map<string, number>;
  timer: NodeJS.Timeout;
}

/** Heartbeats and deadlines of the remote leases this process waits on. @internal */
export class LeaseKeeper<E, K extends LeasedEngine> {
  readonly #o: LeaseKeeperOptions<E, K>;
  readonly #held = new Map<string, Held<E>>();
  #closed = false;
  heartbeatsSent = 0;

  constructor(o: LeaseKeeperOptions<E, K>) {
    this.#o = o;
  }

  /**
   * Keeps the lease on one remote request alive until the returned function
   * is called (holders count: the last release stops it). A no-op for
   * profiles without heartbeats.
   */
  hold(ep: E, remoteRequestId: string): () => void {
    if (!this.#o.wire.heartbeats || this.#closed) return () => {};
    const key = this.#o.keyOf(ep);
    const held = this.#held.get(key) ?? this.#start(key, ep);
    held.ids.set(remoteRequestId, (held.ids.get(remoteRequestId) ?? 0) + 1);
    let done = false;
    return () => {
      if (done) return;
      done = true;
      const n = (held.ids.get(remoteRequestId) ?? 1) - 1;
      if (n > 0) held.ids.set(remoteRequestId, n);
      else {
        held.ids.delete(remoteRequestId);
        held.lastSentMs.delete(remoteRequestId);
      }
      if (held.ids.size === 0 && this.#held.get(key) === held) {
        clearInterval(held.timer);
        this.#held.delete(key);
      }
    };
  }

  #start(key: string, ep: E): Held<E> {
    const every = Math.max(1, Math.floor((this.#o.kvLeaseMs ?? 30_000) / 6));
    const held: Held<E> = {
      ep,
      ids: new Map(),
      lastSentMs: new Map(),
      timer: setInterval(() => void this.#heartbeat(key), every),
    };
    held.timer.unref();
    this.#held.set(key, held);
    return held;
  }

  async #heartbeat(key: string): Promise<void> {
    const h = this.#held.get(key);
    if (!h || h.ids.size === 0) return;
    // Heartbeats trigger handshakes too (vLLM), so a prefill hears of a request before any READ.
    const engine = await this.#o.engineFor(h.ep).catch(() => undefined);
    if (!engine || engine.dropped) return;
    const ids = [...h.ids.keys()];
    const msg = `HB:${ids.join(',')}`;
    // A heartbeat counts towards a lease only once every rank took it.
    const sentAt = performance.now();
    let all = true;
    for (const name of engine.agentNames()) all = this.#o.notify(name, msg) && all;
    if (all) for (const id of ids) if (h.ids.has(id)) h.lastSentMs.set(id, sentAt);
    this.#o.onHeartbeat?.(ids, all);
    this.heartbeatsSent++;
  }

  /**
   * When the prefill may free a request's blocks, on our clock (ms), and the
   * margin a read must keep from it: its expiry time mapped through the
   * handshake's clock offset (or the lease from when it answered), moved
   * later by each heartbeat we sent for the request (vLLM's rule: max(old,
   * sent + 2/3 lease)).
   */
  window(engine: K, lease: RemoteLease, requestId: string): LeaseWindow {
    const mapped = lease.remoteExpiryS != null && engine.clockOffsetS !== undefined;
    let deadlineMs = mapped ? (lease.remoteExpiryS! - engine.clockOffsetS!) * 1000 : lease.issuedAtMs + lease.leaseMs;
    const sent = this.#held.get(engine.key)?.lastSentMs.get(requestId);
    if (sent !== undefined) deadlineMs = Math.max(deadlineMs, sent + Math.floor((lease.leaseMs * 2) / 3));
    const uncertainty = mapped ? engine.bestRttMs / 2 : 0;
    return { deadlineMs, marginMs: uncertainty + (this.#o.leaseSlackMs ?? 50) };
  }

  /** Stops every heartbeat; later holds are no-ops. */
  close(): void {
    this.#closed = true;
    for (const h of this.#held.values()) clearInterval(h.timer);
    this.#held.clear();
  }
}
