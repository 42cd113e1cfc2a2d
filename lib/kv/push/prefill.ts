// The prefill side of push mode (vLLM's NixlPushConnector as the producer):
// take decodes' PUSH_REG registrations, pair each with a finished request
// (offer()), handshake back to the decode (full: its geometry checked with
// this rank as local), and post one WRITE per decode rank this rank maps to
// (vLLM's TP rule, seen from the prefill), with "<decode id>:<our TP size>".
//
// A request's blocks are held from offer() until its WRITEs complete or its
// lease ends (kv_lease_duration, extended by "HB:" heartbeats naming it),
// whichever first; no WRITE is posted after the lease or after the decode's
// own deadline, nothing is retried, and a registration that is malformed,
// forged, for another engine, sent by an agent that is not the decode it
// names, or naming blocks the decode does not have, is refused before any
// memory is touched. For a nixl-node decode (nixl_node_confirm) the
// notification goes only after the WRITEs completed while the blocks were
// still held, as a pull's lease board confirms a read.
import type { Notif, XferHandle } from '../../agent';
import { NixlError } from '../../errors';
import type { WireProfile } from '../../handshake/model';
import type { HandshakeLogger } from '../../handshake/types';
import { defaultLogger } from '../../handshake/types';
import { checkLayout } from '../layout';
import { listenNotifs } from '../notifs';
import { type KvPeers, type PeerEngines, peersFor } from '../peers';
import { Offers } from './offers';
import { type ReceivedReg, RegistrationStore, decodeKey, matchOffer } from './pairing';
import { decodePushReg, isNotifId, isPushReg, pushWire } from './reg';
import { regQuota } from './reg-quota';
import { Refusals } from './refusals';
import type { KvPushSenderOptions, PushSenderStats, PushSent } from './types';
import { type PushDeps, pushOffer } from './writes';

export type { KvPushSenderOptions, PushSenderStats, PushSent } from './types';

const HEARTBEAT = /^HB:(.*)$/s;

/** The prefill side of push mode: pairs registrations with finished requests and WRITEs their KV. */
export class KvPushSender {
  readonly stats: PushSenderStats = {
    registrations: 0,
    refused: 0,
    evicted: 0,
    refusalsSent: 0,
    refusalsLost: 0,
    duplicates: 0,
    mismatched: 0,
    written: 0,
    failed: 0,
    expired: 0,
    bytes: 0,
    heartbeats: 0,
  };
  readonly #o: KvPushSenderOptions;
  readonly #wire: WireProfile;
  readonly #peers: KvPeers;
  /** The peers were made here (else given: their maker closes them). */
  readonly #ownPeers: boolean;
  readonly #engines: PeerEngines;
  readonly #offers: Offers;
  readonly #regs: RegistrationStore;
  readonly #refusals: Refusals;
  readonly #abort = new AbortController();
  readonly #log: HandshakeLogger;
  readonly #deps: PushDeps;
  readonly #loop: Promise<void>;
  #closed = false;

  constructor(o: KvPushSenderOptions) {
    checkLayout(o.layout);
    this.#o = o;
    this.#wire = pushWire(o.wire ?? o.peers?.wire);
    if ((o.layout.ppSize ?? 1) > 1)
      throw new NixlError('a pipeline-parallel push prefill is not supported by nixl-node', 'NIXL_ERR_NOT_SUPPORTED');
    const { peers, own } = peersFor(o, 'KvPushSender');
    this.#peers = peers;
    this.#ownPeers = own;
    this.#log = o.logger ?? defaultLogger;
    this.#engines = peers.engines({ expectedHash: o.expectedHash });
    this.#offers = new Offers(this.stats);
    const q = regQuota(o);
    this.#regs = new RegistrationStore(q.max, o.registrationTtlMs ?? 480_000, undefined, q);
    this.#refusals = new Refusals(o.agent, this.#engines, this.stats, this.#log);
    this.#deps = {
      agent: o.agent,
      layout: o.layout,
      engines: this.#engines,
      local: peers.local,
      refusals: this.#refusals,
      stats: this.stats,
      log: this.#log,
      marginMs: o.marginMs ?? 50,
      transferStats: o.transferStats,
      handles: new Set<XferHandle>(),
    };
    this.#loop = listenNotifs(
      o.agent,
      (n) => this.#mine(n),
      (n) => this.#onNotif(n),
      this.#abort.signal,
    );
  }

  get #leaseMs(): number {
    return this.#o.leaseMs ?? this.#wire.defaultLeaseMs;
  }

  /** Requests offered and not yet settled; registrations waiting for their request, and their cost in bytes. */
  get pending(): { offers: number; registrations: number; registrationBytes: number } {
    return { offers: this.#offers.size, registrations: this.#regs.size, registrationBytes: this.#regs.bytes };
  }

  /** When an offered request's lease ends (performance.now() ms), or undefined. */
  leaseEnd(requestId: string): number | undefined {
    return this.#offers.byId.get(requestId)?.leaseEnd;
  }

  /**
   * A finished request whose blocks (our logical ids, one KV-cache group)
   * wait for a decode's registration. Resolves when they may be freed.
   * `exactBlocks`: the blocks are one whole (no prefix of them is usable), so
   * a decode that registered another count is refused and not written;
   * otherwise a decode registering fewer gets the last ones (its prefix hit).
   */
  offer(requestId: string, blockIds: ArrayLike<number>, opts: { exactBlocks?: boolean } = {}): Promise<PushSent> {
    if (this.#closed) return Promise.reject(new NixlError('push sender is closed', 'NIXL_ERR_NOT_ALLOWED'));
    if (!isNotifId(requestId) || this.#offers.byId.has(requestId))
      return Promise.reject(
        new NixlError(
          `request id '${requestId.slice(0, 80)}' is unusable or already offered`,
          'NIXL_ERR_INVALID_PARAM',
        ),
      );
    const ids = Array.from(blockIds);
    const r = this.#o.layout.physicalBlocksPerLogical ?? 1;
    if (ids.some((b) => !Number.isInteger(b) || b < 0 || (b + 1) * r > this.#o.layout.numBlocks))
      return Promise.reject(new NixlError('offered block ids are outside the local cache', 'NIXL_ERR_INVALID_PARAM'));
    const { offer, sent } = this.#offers.open(requestId, ids, opts.exactBlocks === true, this.#leaseMs);
    // A waiting registration pairs only if it matches no other live request (ambiguity: neither).
    const regs = this.#regs.candidate(requestId, performance.now());
    if (regs && this.#match(regs[0].reg.requestId)?.offer === offer)
      void pushOffer(this.#deps, offer, this.#regs.take(decodeKey(regs[0])));
    return sent;
  }

  #match(decodeRequestId: string) {
    return matchOffer(decodeRequestId, this.#offers.byId, this.#offers.byBase);
  }

  /** Releases an offered request now (no decode will take it); false if it is not offered. */
  abort(requestId: string): boolean {
    const o = this.#offers.byId.get(requestId);
    if (!o) return false;
    o.settle({ reason: 'aborted', bytes: 0, writes: 0 });
    return true;
  }

  /** Registrations, and heartbeats naming one of our offers (the rest is another listener's). */
  #mine(n: Notif): boolean {
    if (isPushReg(n.msg)) return true;
    const hb = HEARTBEAT.exec(n.msg.toString('utf8'));
    return hb?.[1].split(',').some((id) => this.#offers.byId.has(id)) ?? false;
  }

  #onNotif(n: Notif): void {
    if (isPushReg(n.msg)) this.#onRegistration(n);
    else this.#offers.heartbeat(HEARTBEAT.exec(n.msg.toString('utf8'))![1].split(','), this.#leaseMs);
  }

  #onRegistration(n: Notif): void {
    this.stats.registrations++;
    const r = this.#received(n);
    if (typeof r === 'string') {
      this.stats.refused++;
      this.#log.warn(`push: registration refused: ${r}`);
      return;
    }
    // Keyed by (decode engine, request id, sending rank): another rank of one request is not a duplicate.
    if (this.#regs.see(r) === 'duplicate') {
      this.stats.duplicates++;
      return;
    }
    const m = this.#match(r.reg.requestId);
    const d = decodeKey(r);
    if (m && m.offer.decode === d) {
      // Another rank of the decode request being pushed: its WRITE goes into its own blocks.
      m.offer.regs.set(r.from, r);
      m.offer.wake?.();
    } else if (m && m.offer.decode === undefined) {
      void pushOffer(this.#deps, m.offer, [...this.#regs.take(d), r]);
    } else this.#store(r);
  }

  /** Keeps a registration until its request comes, within the quotas; each one not kept is refused at once. */
  #store(r: ReceivedReg): void {
    const { refused, evicted } = this.#regs.add(r);
    if (refused !== undefined) {
      this.stats.refused++;
      this.#turnAway(r, `refused: ${refused}`);
    }
    this.stats.evicted += evicted.length;
    for (const x of evicted) this.#turnAway(x.r, x.why);
  }

  #turnAway(r: ReceivedReg, why: string): void {
    const e = new NixlError(`registration '${r.reg.requestId}' not kept waiting: ${why}`, 'NIXL_ERR_NOT_ALLOWED');
    this.#refusals.warn(e.message);
    this.#refusals.tell(r, e);
  }

  /** A registration fit for this engine, or why it is refused (nothing else is touched). */
  #received(n: Notif): ReceivedReg | string {
    let reg: ReturnType<typeof decodePushReg>;
    try {
      reg = decodePushReg(n.msg, { secret: this.#o.secret, limits: this.#o.regLimits });
    } catch (e) {
      return (e as Error).message;
    }
    // Signed registrations are remembered (duplicates) for the registration TTL; one sent longer ago is a replay.
    const ttl = this.#o.registrationTtlMs ?? 480_000;
    if (this.#o.secret !== undefined && !(reg.sentAtMs !== undefined && Math.abs(Date.now() - reg.sentAtMs) < ttl))
      return `'${reg.requestId}' was not sent within the last ${ttl} ms (a replay, or clocks apart): refused`;
    const l = this.#o.layout;
    if (reg.remoteEngineId !== l.engineId)
      return `'${reg.requestId}' is for engine '${reg.remoteEngineId}', this is '${l.engineId}'`;
    if (reg.remoteTpSize !== l.tpSize || reg.remotePpSize !== 1)
      return `'${reg.requestId}' names TP ${reg.remoteTpSize} x PP ${reg.remotePpSize}, this engine is ${l.tpSize} x 1`;
    if (reg.localBlockIds.length !== 1)
      return `'${reg.requestId}' has ${reg.localBlockIds.length} KV-cache groups; nixl-node pushes one`;
    const now = performance.now();
    const deadlineAt = reg.deadlineMs === undefined ? Number.POSITIVE_INFINITY : now + reg.deadlineMs;
    return { reg, from: n.agent, at: now, deadlineAt };
  }

  /** What the sender holds right now (tests check nothing leaks). */
  resources(): {
    offers: number;
    registrations: number;
    registrationBytes: number;
    seenRegistrations: number;
    xferHandles: number;
    engines: number;
    remoteAgents: number;
  } {
    return {
      offers: this.#offers.size,
      registrations: this.#regs.size,
      registrationBytes: this.#regs.bytes,
      seenRegistrations: this.#regs.seen,
      xferHandles: this.#deps.handles.size,
      engines: this.#engines.size,
      remoteAgents: this.#engines.remoteAgents,
    };
  }

  /** Stops: offered requests settle as expired. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#offers.settleAll({ reason: 'expired', bytes: 0, writes: 0 });
    this.#abort.abort();
    await this.#loop;
    if (this.#ownPeers) await this.#peers.close();
  }
}
