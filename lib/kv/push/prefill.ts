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
import { createHandshake } from '../../handshake';
import type { WireProfile } from '../../handshake/model';
import type { HandshakeLogger, HandshakeStrategy } from '../../handshake/types';
import { defaultLogger } from '../../handshake/types';
import { wireProfile } from '../../handshake/wire';
import { blockDescIds, regionCounts } from '../descs';
import type { RemoteEndpoint } from '../engine-connect';
import { checkLayout } from '../layout';
import { DEFAULT_LIMITS, expandTail } from '../limits';
import { LocalDlists } from '../local-dlists';
import {
  type ReceivedReg,
  RegistrationStore,
  addTo,
  decodeKey,
  matchOffer,
  removeFrom,
  sameRegistration,
} from './pairing';
import { baseRequestId, decodePushReg, isNotifId, isPushReg, writeNotif } from './reg';
import { regQuota } from './reg-quota';
import { Refusals } from './refusals';
import type { KvPushSenderOptions, PushSenderStats, PushSent } from './types';
import { expand } from '../pull/params';
import { type RemoteEngine, RemoteEngines } from '../remote-engines';

export type { KvPushSenderOptions, PushSenderStats, PushSent } from './types';

interface Posted {
  h: XferHandle;
  /** The decode rank (agent) written. */
  to: string;
  /** The WRITE completed (and its rank was confirmed). */
  done: Promise<void>;
}

interface Offer {
  requestId: string;
  blockIds: number[];
  /** The decode must register exactly as many blocks (the KV is one whole). */
  exact: boolean;
  leaseEnd: number;
  timer: NodeJS.Timeout;
  /** Paired and pushing to this decode request (decodeKey); its ranks' registrations by sending agent. */
  decode?: string;
  regs: Map<string, ReceivedReg>;
  /** Wakes a push waiting for a decode rank's registration. */
  wake?: () => void;
  settle(r: Omit<PushSent, 'requestId' | 'blockIds'>): void;
  settled: boolean;
}

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
  readonly #hs: HandshakeStrategy;
  readonly #local: LocalDlists;
  readonly #engines: RemoteEngines;
  readonly #offers = new Map<string, Offer>();
  /** Offered request ids by base id (pairing by base id without a scan). */
  readonly #offerBase = new Map<string, Set<string>>();
  readonly #regs: RegistrationStore;
  readonly #refusals: Refusals;
  readonly #abort = new AbortController();
  readonly #log: HandshakeLogger;
  readonly #handles = new Set<XferHandle>();
  #loop: Promise<void> | undefined;
  #closed = false;

  constructor(o: KvPushSenderOptions) {
    checkLayout(o.layout);
    this.#o = o;
    this.#wire = wireProfile(o.wire);
    if (!this.#wire.transferModes.includes('push'))
      throw new NixlError(
        `push mode is not part of the ${this.#wire.name} wire format (use v12)`,
        'NIXL_ERR_NOT_SUPPORTED',
      );
    if ((o.layout.ppSize ?? 1) > 1)
      throw new NixlError('a pipeline-parallel push prefill is not supported by nixl-node', 'NIXL_ERR_NOT_SUPPORTED');
    this.#hs = typeof o.handshake === 'object' ? o.handshake : createHandshake(o.handshake);
    this.#log = o.logger ?? defaultLogger;
    this.#local = new LocalDlists(o.agent, o.layout);
    this.#engines = new RemoteEngines({
      ...o,
      handshake: this.#hs,
      wire: this.#wire,
      limits: { ...DEFAULT_LIMITS, ...o.limits },
      local: this.#local,
      leaseBoards: false,
    });
    const q = regQuota(o);
    this.#regs = new RegistrationStore(q.max, o.registrationTtlMs ?? 480_000, undefined, q);
    this.#refusals = new Refusals(o.agent, this.#engines, this.stats, this.#log);
    this.#start();
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
    return this.#offers.get(requestId)?.leaseEnd;
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
    if (!isNotifId(requestId) || this.#offers.has(requestId))
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
    return new Promise<PushSent>((resolve) => {
      const o: Offer = {
        requestId,
        blockIds: ids,
        exact: opts.exactBlocks === true,
        leaseEnd: performance.now() + this.#leaseMs,
        timer: undefined as never,
        regs: new Map(),
        settled: false,
        settle: (s) => {
          if (o.settled) return;
          o.settled = true;
          clearTimeout(o.timer);
          o.wake?.();
          if (this.#offers.get(requestId) === o) this.#unoffer(requestId);
          if (s.reason === 'expired') this.stats.expired++;
          else if (s.reason === 'failed') this.stats.failed++;
          else if (s.reason === 'written') this.stats.written++;
          resolve({ requestId, blockIds: ids, ...s });
        },
      };
      this.#offers.set(requestId, o);
      addTo(this.#offerBase, baseRequestId(requestId), requestId);
      this.#arm(o);
      // A waiting registration pairs only if it matches no other live request (ambiguity: neither).
      const regs = this.#regs.candidate(requestId, performance.now());
      if (regs && matchOffer(regs[0].reg.requestId, this.#offers, this.#offerBase)?.offer === o)
        void this.#push(o, this.#regs.take(decodeKey(regs[0])));
    });
  }

  #unoffer(requestId: string): void {
    this.#offers.delete(requestId);
    removeFrom(this.#offerBase, baseRequestId(requestId), requestId);
  }

  /** Releases an offered request now (no decode will take it); false if it is not offered. */
  abort(requestId: string): boolean {
    const o = this.#offers.get(requestId);
    if (!o) return false;
    o.settle({ reason: 'aborted', bytes: 0, writes: 0 });
    return true;
  }

  #arm(o: Offer): void {
    clearTimeout(o.timer);
    o.timer = setTimeout(
      () => {
        if (o.settled) return;
        if (performance.now() >= o.leaseEnd) o.settle({ reason: 'expired', bytes: 0, writes: 0 });
        else this.#arm(o);
      },
      Math.max(0, o.leaseEnd - performance.now()),
    );
  }

  #start(): void {
    this.#loop = (async () => {
      while (!this.#abort.signal.aborted) {
        let n: Notif;
        try {
          n = await this.#o.agent.waitForNotif((x) => this.#mine(x), { signal: this.#abort.signal });
        } catch {
          return;
        }
        if (isPushReg(n.msg)) this.#onRegistration(n);
        else this.#onHeartbeat(n.msg.toString('utf8'));
      }
    })();
  }

  /** Registrations, and heartbeats naming one of our offers (the rest is another listener's). */
  #mine(n: Notif): boolean {
    if (isPushReg(n.msg)) return true;
    const hb = HEARTBEAT.exec(n.msg.toString('utf8'));
    return hb?.[1].split(',').some((id) => this.#offers.has(id)) ?? false;
  }

  /** vLLM's _handle_heartbeat: the lease becomes max(old, now + 2/3 lease). */
  #onHeartbeat(msg: string): void {
    this.stats.heartbeats++;
    const until = performance.now() + Math.floor((this.#leaseMs * 2) / 3);
    for (const id of HEARTBEAT.exec(msg)![1].split(',')) {
      const o = this.#offers.get(id);
      if (o && until > o.leaseEnd) o.leaseEnd = until;
    }
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
    const m = matchOffer(r.reg.requestId, this.#offers, this.#offerBase);
    const d = decodeKey(r);
    if (m && m.offer.decode === d) {
      // Another rank of the decode request being pushed: its WRITE goes into its own blocks.
      m.offer.regs.set(r.from, r);
      m.offer.wake?.();
    } else if (m && m.offer.decode === undefined) {
      void this.#push(m.offer, [...this.#regs.take(d), r]);
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

  /**
   * Handshakes back to the decode and WRITEs each decode rank this rank maps
   * to into the blocks THAT rank registered, once it registered; settles the
   * offer. Never retried. A rank registering other blocks than the first
   * registration of the request is refused (no WRITE to it, and none after),
   * and a rank not registered by the lease end or the decode's deadline is
   * never written: the push fails, ranks already written hold correct bytes.
   */
  async #push(o: Offer, regs: ReceivedReg[]): Promise<void> {
    const first = regs[0];
    o.decode = decodeKey(first);
    for (const r of regs) o.regs.set(r.from, r);
    const { reg } = first;
    const posted: Posted[] = [];
    /** The decode's ranks this rank writes (a refusal goes only to them). */
    let ranks: ReadonlySet<string> = new Set();
    let bytes = 0;
    let err: unknown;
    try {
      const ep: RemoteEndpoint = {
        host: reg.decodeHost,
        port: reg.decodePort,
        tpSize: reg.decodeTpSize,
        engineId: reg.decodeEngineId,
      };
      const engine = await this.#engines.get(ep);
      if (o.settled) return;
      const targets = new Map(engine.reads.map((p) => [p.rank.agentName, p]));
      ranks = new Set(targets.keys());
      if (!targets.has(first.from))
        throw new NixlError(
          `the registration came from agent '${first.from}', which is not a rank of decode '${reg.decodeEngineId}' at ${reg.decodeHost}:${reg.decodePort} this rank writes`,
          'NIXL_ERR_NOT_ALLOWED',
        );
      const notif = writeNotif(reg.requestId, this.#o.layout.tpSize);
      for (;;) {
        for (const [name, p] of targets) {
          const r = o.regs.get(name);
          if (!r) continue;
          targets.delete(name);
          this.#agree(first, r);
          if (p.read.notifyOnly)
            throw new NixlError(
              'push to an MLA decode of larger TP is not supported by nixl-node',
              'NIXL_ERR_NOT_SUPPORTED',
            );
          const { local, remote } = this.#blockIds(engine, o, r.reg.localBlockIds[0]);
          this.#checkTime(o, r);
          const t0 = performance.now();
          const localDescs = blockDescIds(regionCounts(p.read.local.length, this.#o.layout.numBlocks), local);
          const x = this.#post(posted, name, () =>
            this.#o.agent.makePreppedXfer(
              'WRITE',
              this.#local.get(p.read),
              localDescs,
              p.rank.dlist,
              blockDescIds(p.rank.counts, remote),
              r.reg.confirm ? undefined : notif,
            ),
          );
          const size = { bytes: p.blockBytes * local.length, descriptors: localDescs.length };
          x.done = this.#timed(this.#written(o, x.h, r.reg.confirm ? name : undefined, notif), t0, size);
          bytes += size.bytes;
        }
        if (!targets.size) break;
        await this.#nextReg(o, first, [...targets.keys()]);
        if (o.settled) break;
      }
    } catch (e) {
      err = e;
    }
    await this.#finish(o, first, posted, bytes, err, ranks);
  }

  /** Waits for the posted WRITEs (held through them), confirms nixl-node ranks, settles. */
  async #finish(
    o: Offer,
    first: ReceivedReg,
    posted: Posted[],
    bytes: number,
    failure: unknown,
    ranks: ReadonlySet<string>,
  ): Promise<void> {
    const { reg } = first;
    let err = failure;
    try {
      if (o.settled) return;
      const done = await Promise.allSettled(posted.map((x) => x.done));
      err ??= done.find((d) => d.status === 'rejected')?.reason;
      if (o.settled) return;
      if (err === undefined) {
        this.stats.bytes += bytes;
        o.settle({ reason: 'written', decodeRequestId: reg.requestId, bytes, writes: posted.length });
        return;
      }
      const e = err instanceof NixlError ? err : new NixlError(String(err), 'NIXL_ERR_UNKNOWN');
      this.#log.warn(`push of '${o.requestId}' to '${reg.requestId}' failed (not retried): ${e.message}`);
      // A nixl-node decode rank not written would otherwise wait out its deadline for a notification that cannot come.
      const written = new Set(posted.filter((_, i) => done[i]?.status === 'fulfilled').map((x) => x.to));
      for (const [name, r] of o.regs) if (ranks.has(name) && !written.has(name)) this.#refusals.tell(r, e);
      o.settle({ reason: 'failed', decodeRequestId: reg.requestId, bytes: 0, writes: posted.length, error: e });
    } finally {
      for (const { h } of posted) {
        this.#handles.delete(h);
        try {
          this.#o.agent.releaseXferHandle(h);
        } catch {
          /* agent closed */
        }
      }
    }
  }

  /**
   * Makes and posts one WRITE. WRITEs are counted in the transfer stats
   * (transferStats), as vLLM's push prefill counts them (the side that posts
   * a transfer records it): one that fails to post or to complete is a failed
   * transfer; one done, its post time, time to completion, bytes, descriptors.
   */
  #post(posted: Posted[], to: string, make: () => XferHandle): Posted {
    try {
      const x: Posted = { h: make(), to, done: Promise.resolve() };
      posted.push(x);
      this.#handles.add(x.h);
      this.#o.agent.transfer(x.h);
      return x;
    } catch (e) {
      this.#o.transferStats?.recordFailedTransfer();
      throw e;
    }
  }

  /** The WRITE posted at t0 (see #post) ending in `done`: counted, its post time being until now. */
  async #timed(done: Promise<void>, t0: number, size: { bytes: number; descriptors: number }): Promise<void> {
    const stats = this.#o.transferStats;
    const postMs = performance.now() - t0;
    try {
      await done;
    } catch (e) {
      stats?.recordFailedTransfer();
      throw e;
    }
    stats?.recordTransfer(size.bytes, size.descriptors, postMs, performance.now() - t0 - postMs);
  }

  /** One WRITE done; a nixl-node rank (confirm) is told only now, while the blocks are still held. */
  async #written(o: Offer, h: XferHandle, confirmTo: string | undefined, notif: string): Promise<void> {
    await this.#o.agent.wait(h, { timeoutMs: Math.max(1, o.leaseEnd - performance.now()) });
    // Held through the WRITE (the lease did not end under it): only now is the KV the decode's.
    if (confirmTo !== undefined && !o.settled) this.#o.agent.sendNotif(confirmTo, notif);
  }

  /** A rank's registration must name the blocks (and decode) the request's first one names. */
  #agree(first: ReceivedReg, r: ReceivedReg): void {
    if (sameRegistration(first.reg, r.reg)) return;
    this.stats.mismatched++;
    throw new NixlError(
      `decode rank '${r.from}' registered ${r.reg.localBlockIds[0].length} blocks for '${r.reg.requestId}' that disagree with rank '${first.from}''s ${first.reg.localBlockIds[0].length} (or another decode address): '${r.from}' is not written`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }

  /** Waits for another decode rank's registration, bounded by the lease and the decode's deadline. */
  async #nextReg(o: Offer, first: ReceivedReg, missing: string[]): Promise<void> {
    const bound = Math.min(o.leaseEnd, first.deadlineAt) - (this.#o.marginMs ?? 50);
    const wait = bound - performance.now();
    if (wait <= 0)
      throw new NixlError(
        `decode rank(s) ${missing.join(', ')} never registered '${first.reg.requestId}' with this rank in time: not written`,
        'NIXL_ERR_TIMEOUT',
      );
    await new Promise<void>((resolve) => {
      const t = setTimeout(resolve, Math.min(wait, 2 ** 31 - 1));
      o.wake = () => {
        clearTimeout(t);
        o.wake = undefined;
        resolve();
      };
    });
  }

  /** Neither the lease nor the decode's deadline may end before the WRITE could. */
  #checkTime(o: Offer, r: ReceivedReg): void {
    const now = performance.now();
    const margin = this.#o.marginMs ?? 50;
    if (o.settled || now + margin >= o.leaseEnd)
      throw new NixlError(`the lease on '${o.requestId}' is over: no WRITE after it`, 'NIXL_ERR_LEASE_EXPIRED');
    if (now + margin >= r.deadlineAt)
      throw new NixlError(
        `decode '${r.reg.requestId}' has given up (its deadline passed): no WRITE`,
        'NIXL_ERR_TIMEOUT',
      );
  }

  /**
   * Our kernel ids, end-trimmed to the decode's count (a prefix hit on the
   * decode registers fewer), and the decode's, checked against what its
   * ranks hold. The decode asking for more blocks than we have is refused,
   * and for fewer when the offer is exact (a truncated whole is no KV).
   */
  #blockIds(engine: RemoteEngine, o: Offer, theirs: number[]): { local: number[]; remote: number[] } {
    const ours = o.blockIds;
    if (o.exact && theirs.length !== ours.length)
      throw new NixlError(
        `the decode registered ${theirs.length} blocks, this request's KV is one whole of ${ours.length}: refused, nothing written (prompts differ?)`,
        'NIXL_ERR_MISMATCH',
      );
    if (theirs.length > ours.length)
      throw new NixlError(
        `the decode registered ${theirs.length} blocks, this request has ${ours.length}: refused (prompts differ?)`,
        'NIXL_ERR_INVALID_PARAM',
      );
    const dRatio = engine.physicalBlocksPerLogical;
    const nRemote = Math.min(...[...engine.ranks.values()].flatMap((x) => x.counts));
    const remote = expandTail(theirs, dRatio, theirs.length * dRatio, nRemote, 'registered block ids');
    const local = expand(ours.slice(ours.length - theirs.length), this.#o.layout.physicalBlocksPerLogical ?? 1);
    if (local.length !== remote.length)
      throw new NixlError(
        `kernel blocks differ: ${local.length} here, ${remote.length} on the decode (physical blocks per logical differ)`,
        'NIXL_ERR_NOT_SUPPORTED',
      );
    return { local, remote };
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
      xferHandles: this.#handles.size,
      engines: this.#engines.size,
      remoteAgents: this.#engines.remoteAgents,
    };
  }

  /** Stops: offered requests settle as expired. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const o of [...this.#offers.values()]) o.settle({ reason: 'expired', bytes: 0, writes: 0 });
    this.#abort.abort();
    await this.#loop;
    await this.#engines.close();
    this.#local.close();
    this.#hs.close();
  }
}
