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
import type { NixlAgent, Notif, XferHandle } from '../agent';
import { NixlError } from '../errors';
import { createHandshake } from '../handshake';
import type { WireName, WireProfile } from '../handshake/model';
import type { HandshakeLogger, HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../handshake/types';
import { defaultLogger } from '../handshake/types';
import { wireProfile } from '../handshake/wire';
import { blockDescIds, regionCounts } from './descs';
import type { RemoteEndpoint } from './engine-connect';
import { checkLayout, type KvLayout } from './layout';
import { DEFAULT_LIMITS, type PullLimits, expandTail } from './limits';
import { LocalDlists } from './local-dlists';
import { type ReceivedReg, RegistrationStore, matchOffer } from './push-pairing';
import { type PushRegLimits, decodePushReg, isNotifId, isPushReg, writeNotif } from './push-reg';
import { expand } from './pull-params';
import { type RemoteEngine, RemoteEngines } from './remote-engines';

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
  /** kv_lease_duration: blocks of an offered request are held at most this long (heartbeats extend). Default 30 s. */
  leaseMs?: number;
  /** No WRITE is posted closer than this to the lease end or the decode's deadline. Default 50 ms. */
  marginMs?: number;
  /** Require registrations signed with this KV secret. */
  secret?: string | Buffer;
  regLimits?: PushRegLimits;
  /** Registrations kept waiting for their request. Default 4096. */
  maxPendingRegistrations?: number;
  /** How long an unpaired registration is kept. Default 480 s (vLLM's decoder_kv_blocks_ttl). */
  registrationTtlMs?: number;
  limits?: PullLimits;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
  logger?: HandshakeLogger;
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

interface Offer {
  requestId: string;
  blockIds: number[];
  leaseEnd: number;
  timer: NodeJS.Timeout;
  /** Paired and pushing: a second registration is a duplicate. */
  pushing: boolean;
  settle(r: Omit<PushSent, 'requestId' | 'blockIds'>): void;
  settled: boolean;
}

/** Counters of a KvPushSender. */
export interface PushSenderStats {
  registrations: number;
  refused: number;
  duplicates: number;
  written: number;
  failed: number;
  expired: number;
  bytes: number;
  heartbeats: number;
}

const HEARTBEAT = /^HB:(.*)$/s;

/** The prefill side of push mode: pairs registrations with finished requests and WRITEs their KV. */
export class KvPushSender {
  readonly stats: PushSenderStats = {
    registrations: 0,
    refused: 0,
    duplicates: 0,
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
  readonly #regs: RegistrationStore;
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
    this.#regs = new RegistrationStore(o.maxPendingRegistrations ?? 4096, o.registrationTtlMs ?? 480_000);
    this.#start();
  }

  get #leaseMs(): number {
    return this.#o.leaseMs ?? this.#wire.defaultLeaseMs;
  }

  /** Requests offered and not yet settled; registrations waiting for their request. */
  get pending(): { offers: number; registrations: number } {
    return { offers: this.#offers.size, registrations: this.#regs.size };
  }

  /** When an offered request's lease ends (performance.now() ms), or undefined. */
  leaseEnd(requestId: string): number | undefined {
    return this.#offers.get(requestId)?.leaseEnd;
  }

  /**
   * A finished request whose blocks (our logical ids, one KV-cache group)
   * wait for a decode's registration. Resolves when they may be freed.
   */
  offer(requestId: string, blockIds: ArrayLike<number>): Promise<PushSent> {
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
        leaseEnd: performance.now() + this.#leaseMs,
        timer: undefined as never,
        pushing: false,
        settled: false,
        settle: (s) => {
          if (o.settled) return;
          o.settled = true;
          clearTimeout(o.timer);
          if (this.#offers.get(requestId) === o) this.#offers.delete(requestId);
          if (s.reason === 'expired') this.stats.expired++;
          else if (s.reason === 'failed') this.stats.failed++;
          else if (s.reason === 'written') this.stats.written++;
          resolve({ requestId, blockIds: ids, ...s });
        },
      };
      this.#offers.set(requestId, o);
      this.#arm(o);
      const reg = this.#regs.take(requestId, performance.now());
      if (reg) void this.#push(o, reg);
    });
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
    const m = matchOffer(r.reg.requestId, this.#offers);
    const refusal = m?.offer.pushing ? 'duplicate' : this.#regs.add(r);
    if (refusal === 'duplicate') {
      this.stats.duplicates++;
    } else if (refusal === 'full') {
      this.stats.refused++;
      this.#log.warn(`push: registration '${r.reg.requestId}' refused: too many registrations waiting`);
    } else if (m) {
      this.#regs.drop(r.reg.requestId);
      void this.#push(m.offer, r);
    }
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

  /** Handshakes back to the decode and WRITEs; settles the offer. Never retried. */
  async #push(o: Offer, r: ReceivedReg): Promise<void> {
    o.pushing = true;
    const { reg } = r;
    const handles: XferHandle[] = [];
    let bytes = 0;
    try {
      const ep: RemoteEndpoint = {
        host: reg.decodeHost,
        port: reg.decodePort,
        tpSize: reg.decodeTpSize,
        engineId: reg.decodeEngineId,
      };
      const engine = await this.#engines.get(ep);
      if (o.settled) return;
      if (!engine.agentNames().includes(r.from))
        throw new NixlError(
          `the registration came from agent '${r.from}', which is not a rank of decode '${reg.decodeEngineId}' at ${reg.decodeHost}:${reg.decodePort}`,
          'NIXL_ERR_NOT_ALLOWED',
        );
      const { local, remote } = this.#blockIds(engine, o.blockIds, reg.localBlockIds[0]);
      this.#checkTime(o, r);
      const notif = writeNotif(reg.requestId, this.#o.layout.tpSize);
      for (const p of engine.reads) {
        if (p.read.notifyOnly)
          throw new NixlError(
            'push to an MLA decode of larger TP is not supported by nixl-node',
            'NIXL_ERR_NOT_SUPPORTED',
          );
        const regions = p.read.local.length;
        const h = this.#o.agent.makePreppedXfer(
          'WRITE',
          this.#local.get(p.read),
          blockDescIds(regionCounts(regions, this.#o.layout.numBlocks), local),
          p.rank.dlist,
          blockDescIds(p.rank.counts, remote),
          reg.confirm ? undefined : notif,
        );
        handles.push(h);
        this.#handles.add(h);
        this.#o.agent.transfer(h);
        bytes += p.blockBytes * local.length;
      }
      const left = Math.max(1, o.leaseEnd - performance.now());
      await Promise.all(handles.map((h) => this.#o.agent.wait(h, { timeoutMs: left })));
      // Held through the WRITE (the lease did not end under it): only now is the KV the decode's.
      if (o.settled) return;
      if (reg.confirm) for (const name of engine.agentNames()) this.#o.agent.sendNotif(name, notif);
      this.stats.bytes += bytes;
      o.settle({ reason: 'written', decodeRequestId: reg.requestId, bytes, writes: handles.length });
    } catch (e) {
      const err = e instanceof NixlError ? e : new NixlError(String(e), 'NIXL_ERR_UNKNOWN');
      this.#log.warn(`push of '${o.requestId}' to '${reg.requestId}' failed (not retried): ${err.message}`);
      o.settle({ reason: 'failed', decodeRequestId: reg.requestId, bytes: 0, writes: handles.length, error: err });
    } finally {
      for (const h of handles) {
        this.#handles.delete(h);
        try {
          this.#o.agent.releaseXferHandle(h);
        } catch {
          /* agent closed */
        }
      }
    }
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
   * ranks hold. The decode asking for more blocks than we have is refused.
   */
  #blockIds(engine: RemoteEngine, ours: number[], theirs: number[]): { local: number[]; remote: number[] } {
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
  resources(): { offers: number; registrations: number; xferHandles: number; engines: number; remoteAgents: number } {
    return {
      offers: this.#offers.size,
      registrations: this.#regs.size,
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
