// The decode side: handshake with the prefill ranks this rank reads from
// (every pipeline rank x the TP ranks it maps to, nothing else), prepare
// descriptor lists once per remote engine and rank, keep the prefill's lease
// alive with heartbeats while a request waits (v12), and pull a request's
// blocks with one call, from block ids or straight from kv_transfer_params.
import type { NixlAgent, XferHandle, DlistHandle } from '../agent';
import { DescList } from '../descriptors';
import { NixlError } from '../errors';
import { createHandshake } from '../handshake';
import type { KvTransferParams, NixlAgentMetadata, WireName, WireProfile } from '../handshake/model';
import type { HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../handshake/types';
import { parseKvTransferParams, wireProfile } from '../handshake/wire';
import { type BlockSlices, allBlockDescs, blockDescIds, coalescedDescs, regionCounts } from './descs';
import { checkLayout, type KvLayout } from './layout';
import { DEFAULT_LIMITS, type PullLimits, checkRemoteCounts, checkRemoteSizes, expandTail } from './limits';
import { BoardReader, PROBE, type SlotState } from './lease-board';
import { type SpanLike, type TraceContext, startSpan } from '../tracing';
import { verifyKvTransferParams } from './params-auth';
import { KvStats } from './stats';
import { type RankRead, type ReadPlan, completionNotif, handshakeTargets, planReads } from './tp';

/** A prefill engine to pull from: its side channel and engine id. */
export interface RemoteEndpoint {
  host: string;
  /** The prefill engine's advertised side-channel port (kv_transfer_params remote_port). */
  port: number;
  tpSize: number;
  /** Added to port for ZMQ (vLLM's remote_port already includes it: leave 0 then). */
  dpRank?: number;
  /** Pipeline ranks of the prefill engine. Default 1. */
  ppSize?: number;
  /** Default 1 (nixl-node does not read from DCP > 1). */
  dcpSize?: number;
  /** The engine id kv_transfer_params named: the metadata must carry it. */
  engineId?: string;
}

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
   * Until when the prefill holds the blocks. Without it the pull trusts the
   * blocks whenever it reads them (pullFromParams always gives one).
   */
  lease?: RemoteLease;
  /** The span this pull's span is a child of (tracing.ts); default: the active context. */
  traceContext?: TraceContext;
}

/** What the prefill promised about how long it holds a request's blocks. */
export interface RemoteLease {
  /** v12 remote_blocks_expiry_time: the prefill's monotonic clock, seconds (mapped with the handshake's offset). */
  remoteExpiryS?: number | null;
  /** When the prefill answered, on this process's performance.now() (ms): the lease runs from there otherwise. */
  issuedAtMs: number;
  /** The lease length when no expiry time is given (the profile's), and what a heartbeat extends by 2/3 of. */
  leaseMs: number;
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

interface RemoteRank {
  ppRank: number;
  rank: number;
  agentName: string;
  meta: NixlAgentMetadata;
  dlist: DlistHandle;
  /** Blocks per region of its prepped list. */
  counts: readonly number[];
  /** [address, slots] of its lease board (a nixl-node prefill): reads are confirmed against it. */
  board?: readonly bigint[];
}

/** One planned read with its block slices on both sides, fixed at connect time. */
interface PreparedRead {
  read: RankRead;
  rank: RemoteRank;
  local: BlockSlices;
  remote: BlockSlices;
  /** Bytes one block contributes (all regions). */
  blockBytes: number;
}

interface RemoteEngine {
  key: string;
  engineId: string;
  /** The plan of pipeline rank 0 (all pipeline ranks map TP alike). */
  plan: ReadPlan;
  ranks: Map<string, RemoteRank>;
  reads: PreparedRead[];
  numBlocks: number;
  /** Kernel blocks per logical block on the prefill side. */
  physicalBlocksPerLogical: number;
  handshakeMs: number;
  /** v12: prefill clock - our clock, seconds, from the lowest-RTT handshake sample. */
  clockOffsetS: number | undefined;
  /** The lowest handshake round trip, ms: half of it bounds the clock offset's error. */
  bestRttMs: number;
  /** Its remote agents were removed and dlists released (once). */
  dropped: boolean;
  /** Pulls using it right now; a replaced engine is dropped when they end. */
  pulls: number;
  /** Set when a newer incarnation of the same prefill replaced it. */
  retired?: () => void;
}

// Errors of the setup half of a connect (addRemoteAgent, prepXferDlist): the
// handshake itself worked, so the pull fails as kind 'setup'.
const setupErrors = new WeakSet<object>();

/**
 * The decode side of disaggregated serving: handshakes with prefill engines,
 * maps TP ranks, pulls blocks, sends the completion notification, and fails a
 * pull it cannot prove right (lease expired, peer gone, bad metadata).
 */
export class KvPuller {
  readonly stats = new KvStats();
  readonly #agent: NixlAgent;
  readonly #layout: KvLayout;
  readonly #hs: HandshakeStrategy;
  readonly #opts: KvPullerOptions;
  readonly #engines = new Map<string, Promise<RemoteEngine>>();
  readonly #localDlists = new Map<string, DlistHandle>();
  /** Pull slots per remote engine key: one stalled prefill queues only its own pulls. */
  readonly #slots = new Map<string, { active: number; waiting: Array<() => void> }>();
  /** Connected engines not dropped yet, and how many of them use each loaded remote agent. */
  readonly #live = new Set<RemoteEngine>();
  readonly #agentUsers = new Map<string, number>();
  readonly #wire: WireProfile;
  readonly #limits: Required<PullLimits>;
  /** Remote requests waiting here, per engine: heartbeats keep their leases. */
  readonly #held = new Map<
    string,
    { ep: RemoteEndpoint; ids: Map<string, number>; timer: NodeJS.Timeout; lastSentMs: Map<string, number> }
  >();
  heartbeatsSent = 0;
  #xfers = 0;
  #closed = false;
  /** Bytes per ms of recent pulls (EWMA): what a pull is expected to take, against its lease. */
  #rate = 0;
  readonly #boards: BoardReader;
  /** The span of each pull in flight, by remote request id (heartbeats are events on it). */
  readonly #pullSpans = new Map<string, SpanLike>();

  constructor(opts: KvPullerOptions) {
    checkLayout(opts.layout);
    this.#agent = opts.agent;
    this.#layout = opts.layout;
    this.#opts = opts;
    this.#hs = typeof opts.handshake === 'object' ? opts.handshake : createHandshake(opts.handshake);
    this.#wire = wireProfile(opts.wire);
    this.#limits = { ...DEFAULT_LIMITS, ...opts.limits };
    this.#boards = new BoardReader(opts.agent);
  }

  get wire(): WireProfile {
    return this.#wire;
  }

  /** Handshakes and prepares descriptor lists ahead of the first pull (pulls do it once per remote engine). */
  async connect(ep: RemoteEndpoint): Promise<void> {
    await this.#engineFor(ep);
  }

  #engineFor(ep: RemoteEndpoint): Promise<RemoteEngine> {
    const key = engineKey(ep);
    let p = this.#engines.get(key);
    if (!p) {
      const mine = this.#connect(key, ep);
      this.#engines.set(key, mine);
      // Only this connect's own entry: a newer one for the same key stays.
      mine.catch(() => {
        if (this.#engines.get(key) === mine) this.#engines.delete(key);
      });
      p = mine;
    }
    return p;
  }

  async #connect(key: string, ep: RemoteEndpoint): Promise<RemoteEngine> {
    const t0 = performance.now();
    const targets = asSetup(() => {
      checkRemoteSizes(this.#layout, ep, this.#limits);
      return handshakeTargets(this.#layout.tpSize, this.#layout.tpRank, ep);
    });
    const fetch = (t: { ppRank: number; tpRank: number }) =>
      this.#hs.fetch({
        host: ep.host,
        port: ep.port,
        dpRank: ep.dpRank,
        tpRank: t.tpRank,
        ppRank: t.ppRank,
        wire: this.#wire,
        expectedHash: this.#opts.expectedHash,
        timeoutMs: this.#opts.handshakeTimeoutMs,
        tls: this.#opts.tls,
        bearerToken: this.#opts.bearerToken,
      });
    // The first rank alone first: its metadata must fit the TP size the
    // request names (block lengths follow from the TP ratio) before we ask
    // the others, since asking a vLLM prefill for a rank it does not have
    // kills its side-channel listener (a forged tp_size would).
    const head = await fetch(targets[0]);
    asSetup(() => checkRemoteCounts(head.metadata, this.#limits));
    const ctx = (ep.ppSize ?? 1) > 1 ? { ppRank: 0, regionStart: 0, dcpSize: ep.dcpSize } : { dcpSize: ep.dcpSize };
    planReads(this.#layout, ep.tpSize, head.metadata, ctx);
    // Then the rest, at most handshakeConcurrency sockets open at once.
    const fetched = [head, ...(await mapLimit(targets.slice(1), this.#limits.handshakeConcurrency, fetch))];
    const metas = fetched.map((f) => f.metadata);
    const first = metas[0];
    asSetup(() => {
      for (const m of metas) checkRemoteCounts(m, this.#limits);
    });
    // Every rank must agree with us (and with each other) before anything is registered.
    metas.forEach((m, i) => {
      if (ep.engineId !== undefined && m.engineId !== ep.engineId)
        throw new NixlError(
          `engine_id: remote (pp ${targets[i].ppRank}, tp ${targets[i].tpRank}) sent '${m.engineId}', kv_transfer_params named '${ep.engineId}'`,
          'NIXL_ERR_MISMATCH',
        );
      if (m.engineId !== first.engineId || m.numBlocks !== first.numBlocks)
        throw new NixlError(
          `remote ranks disagree on engine_id or num_blocks: ${first.engineId}/${first.numBlocks} vs ${m.engineId}/${m.numBlocks}`,
          'NIXL_ERR_MISMATCH',
        );
    });
    const ppSize = ep.ppSize ?? 1;
    const plans: ReadPlan[] = [];
    const perPp = targets.length / ppSize;
    let regionStart = 0;
    for (let pp = 0; pp < ppSize; pp++) {
      const ctx = ppSize > 1 ? { ppRank: pp, regionStart, dcpSize: ep.dcpSize } : { dcpSize: ep.dcpSize };
      const own = metas.slice(pp * perPp, (pp + 1) * perPp);
      plans.push(planReads(this.#layout, ep.tpSize, own[0], ctx));
      for (const m of own.slice(1)) planReads(this.#layout, ep.tpSize, m, ctx);
      regionStart += own[0].kvCachesBaseAddr.length;
    }
    if (regionStart !== this.#layout.baseAddrs.length)
      throw new NixlError(
        `kv_caches_base_addr (regions): the ${ppSize} pipeline ranks hold ${regionStart}, local ${this.#layout.baseAddrs.length}`,
        'NIXL_ERR_MISMATCH',
      );
    // The clock offset of the sample with the lowest round trip (vLLM).
    let best: (typeof fetched)[number] | undefined;
    for (const f of fetched) if (f.clockOffsetS !== undefined && (!best || f.rttMs < best.rttMs)) best = f;
    // A restarted prefill (same engine id, new agents) replaces what we hold
    // of its old self: that must be unloaded before the new agents load.
    await this.#replaceOlder(first.engineId, metas);

    const ranks = new Map<string, RemoteRank>();
    const reads: PreparedRead[] = [];
    const engine: RemoteEngine = {
      key,
      engineId: first.engineId,
      plan: plans[0],
      ranks,
      reads,
      numBlocks: first.numBlocks,
      physicalBlocksPerLogical: first.physicalBlocksPerLogical,
      handshakeMs: 0,
      clockOffsetS: best?.clockOffsetS,
      bestRttMs: Math.min(...fetched.map((f) => f.rttMs)),
      dropped: false,
      pulls: 0,
    };
    const added: string[] = [];
    const dlists: DlistHandle[] = [];
    try {
      if (this.#closed) throw new NixlError('puller is closed', 'NIXL_ERR_NOT_ALLOWED');
      targets.forEach((t, i) => {
        const meta = metas[i];
        const read = plans[t.ppRank].reads[i % perPp];
        const local = this.#localSlices(read);
        const remote: BlockSlices = {
          baseAddrs: meta.kvCachesBaseAddr,
          strides: meta.blockStrides,
          offsets: read.remoteOffset,
          lens: local.lens,
          devId: meta.deviceId,
        };
        const counts = meta.regionNumBlocks ?? regionCounts(meta.kvCachesBaseAddr.length, meta.numBlocks);
        // The same prefill reached under another key (host name, engine id
        // given or not) shares the agent already loaded.
        const agentName = this.#loadedAs(meta.agentMetadata) ?? this.#agent.addRemoteAgent(meta.agentMetadata);
        this.#agentUsers.set(agentName, (this.#agentUsers.get(agentName) ?? 0) + 1);
        added.push(agentName);
        const dlist = this.#agent.prepXferDlist(
          agentName,
          new DescList(allBlockDescs(remote, counts), this.#layout.memType ?? 'DRAM'),
        );
        dlists.push(dlist);
        const r: RemoteRank = {
          ppRank: t.ppRank,
          rank: t.tpRank,
          agentName,
          meta,
          dlist,
          counts,
          board: this.#opts.leaseBoards === false ? undefined : usableBoard(meta.nixlNodeLeaseBoard),
        };
        ranks.set(`${t.ppRank}:${t.tpRank}`, r);
        if (!read.notifyOnly) this.#localDlist(read);
        reads.push({ read, rank: r, local, remote, blockBytes: local.lens.reduce((a, b) => a + b, 0) });
      });
    } catch (e) {
      // Undo everything this connect loaded, so that the next handshake
      // (a corrected or restarted prefill with the same agent names) loads.
      for (const d of dlists) this.#quietly(() => this.#agent.releaseDlistHandle(d));
      for (const n of added) this.#unuseAgent(n);
      if (typeof e === 'object' && e !== null) setupErrors.add(e);
      throw e;
    }
    engine.handshakeMs = performance.now() - t0;
    this.#live.add(engine);
    return engine;
  }

  /** The name under which exactly this agent metadata is loaded already, if it is. */
  #loadedAs(md: Buffer): string | undefined {
    for (const e of this.#live)
      for (const r of e.ranks.values()) if (r.meta.agentMetadata.equals(md)) return r.agentName;
    return undefined;
  }

  #unuseAgent(name: string): void {
    const n = (this.#agentUsers.get(name) ?? 1) - 1;
    if (n > 0) {
      this.#agentUsers.set(name, n);
      return;
    }
    this.#agentUsers.delete(name);
    this.#quietly(() => this.#agent.removeRemoteAgent(name));
  }

  /**
   * Engines we hold for `engineId` whose agents are not among the new
   * metadata are an older incarnation of that prefill (it restarted, maybe on
   * another port): no new pull uses them, and once their pulls end their
   * agents are unloaded. Resolves then when the new agents may take an old
   * one's name (a restart under the same name); at once otherwise, so pulls
   * to another prefill never wait behind a stalled one's.
   */
  async #replaceOlder(engineId: string, metas: NixlAgentMetadata[]): Promise<void> {
    const olds = [...this.#live].filter(
      (e) =>
        e.engineId === engineId &&
        [...e.ranks.values()].some((r) => !metas.some((m) => m.agentMetadata.equals(r.meta.agentMetadata))),
    );
    // Both engines write the agent's name into its metadata as it is.
    const named = (old: RemoteEngine) =>
      [...old.ranks.values()].some((r) => metas.some((m) => m.agentMetadata.includes(Buffer.from(r.agentName))));
    await Promise.all(
      olds.map((old) => {
        const p = this.#engines.get(old.key);
        if (p) void p.then((e) => e === old && this.#engines.get(old.key) === p && this.#engines.delete(old.key));
        if (old.pulls === 0) {
          this.#forget(old, undefined);
          return undefined;
        }
        if (!named(old)) {
          old.retired = () => this.#forget(old, undefined);
          return undefined;
        }
        return new Promise<void>((resolve) => {
          old.retired = () => {
            this.#forget(old, undefined);
            resolve();
          };
        });
      }),
    );
  }

  #localSlices(read: RankRead): BlockSlices {
    const l = this.#layout;
    const end = read.regionStart + read.local.length;
    return {
      baseAddrs: l.baseAddrs.slice(read.regionStart, end),
      strides: (l.blockStrides ?? l.blockLens).slice(read.regionStart, end),
      offsets: read.local.map((s) => s.offset),
      lens: read.local.map((s) => s.len),
      devId: l.deviceId ?? 0,
    };
  }

  #localDlist(read: RankRead): DlistHandle {
    const key = `${read.regionStart}/${read.local.map((s) => `${s.offset}+${s.len}`).join(',')}`;
    let d = this.#localDlists.get(key);
    if (!d) {
      d = this.#agent.prepXferDlist(
        '',
        new DescList(allBlockDescs(this.#localSlices(read), this.#layout.numBlocks), this.#layout.memType ?? 'DRAM'),
      );
      this.#localDlists.set(key, d);
    }
    return d;
  }

  #quietly(f: () => void): void {
    try {
      f();
    } catch {
      /* already gone, or the agent is closed */
    }
  }

  /**
   * Forgets one connected engine: its map entry only if it is still the
   * current one (a newer connect for the key stays), and its remote agents
   * and dlists once, however many of its pulls fail. Synchronous, so a new
   * connect can never see the old agents still loaded.
   */
  #forget(engine: RemoteEngine, promise: Promise<RemoteEngine> | undefined): void {
    if (promise && this.#engines.get(engine.key) === promise) this.#engines.delete(engine.key);
    if (engine.dropped) return;
    engine.dropped = true;
    this.#live.delete(engine);
    for (const r of engine.ranks.values()) {
      this.#quietly(() => this.#agent.releaseDlistHandle(r.dlist));
      this.#unuseAgent(r.agentName);
    }
  }

  /** A pull slot for one remote engine (maxConcurrent per engine). */
  async #slot(key: string, signal?: AbortSignal): Promise<void> {
    const max = this.#opts.maxConcurrent ?? 16;
    let q = this.#slots.get(key);
    if (!q) {
      q = { active: 0, waiting: [] };
      this.#slots.set(key, q);
    }
    const slots = q;
    if (slots.active < max) {
      slots.active++;
      return;
    }
    await new Promise<void>((resolve, reject) => {
      const go = () => {
        signal?.removeEventListener('abort', onAbort);
        slots.active++;
        resolve();
      };
      const onAbort = () => {
        const i = slots.waiting.indexOf(go);
        if (i >= 0) slots.waiting.splice(i, 1);
        reject(new NixlError('pull aborted while queued', 'NIXL_ERR_CANCELED', undefined, { cause: signal?.reason }));
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      slots.waiting.push(go);
    });
  }

  #release(key: string): void {
    const q = this.#slots.get(key);
    if (!q) return;
    q.active--;
    const next = q.waiting.shift();
    if (next) next();
    else if (q.active === 0) this.#slots.delete(key);
  }

  /**
   * Pulls blocks of one request. Traced as span 'kv.pull' with children
   * kv.handshake, kv.post, kv.transfer, kv.confirm and kv.notify.
   */
  async pullBlocks(opts: PullOptions): Promise<PullResult> {
    const span = startSpan('kv.pull', {
      kind: 'client',
      parent: opts.traceContext,
      attributes: {
        'nixl_node.remote_request_id': opts.requestId,
        'nixl_node.remote': `${opts.remote.host}:${opts.remote.port}`,
        'nixl_node.engine': this.#agent.engine,
      },
    });
    this.#pullSpans.set(opts.requestId, span);
    try {
      const r = await this.#pull(opts, span);
      span.setAttribute('nixl_node.bytes', r.bytes);
      span.setAttribute('nixl_node.descriptors', r.descriptors);
      span.setAttribute('nixl_node.remote_ranks', r.remoteRanks.join(','));
      return r;
    } catch (e) {
      if (e instanceof PullError) span.setAttribute('nixl_node.pull_failure', e.kind);
      span.fail(e);
      throw e;
    } finally {
      if (this.#pullSpans.get(opts.requestId) === span) this.#pullSpans.delete(opts.requestId);
      span.end();
    }
  }

  async #pull(opts: PullOptions, span: SpanLike): Promise<PullResult> {
    const child = (name: string, attributes?: Record<string, string | number | boolean>) =>
      startSpan(name, { parent: span.context, attributes });
    const localIds = Array.from(opts.localBlockIds);
    const fail = (kind: PullFailure, e: unknown): PullError => {
      if (e instanceof PullError) return e;
      const err = e as NixlError;
      return new PullError(
        `pull of request '${opts.requestId}' failed (${kind}): ${err?.message ?? e}`,
        err?.code ?? 'NIXL_ERR_UNKNOWN',
        kind,
        opts.requestId,
        localIds,
        e,
      );
    };
    if (this.#closed) throw fail('setup', new NixlError('puller is closed', 'NIXL_ERR_NOT_ALLOWED'));
    const bad = (m: string) => fail('setup', new NixlError(m, 'NIXL_ERR_INVALID_PARAM'));
    const nLocal = this.#layout.numBlocks;
    if (localIds.length > nLocal) throw bad(`${localIds.length} local blocks asked, the local cache has ${nLocal}`);
    if (localIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nLocal))
      throw bad(`local block ids must be integers in 0..${nLocal - 1}`);
    if (!opts.remoteIdsAreLogical && localIds.length > opts.remoteBlockIds.length)
      throw bad(`${localIds.length} local blocks but only ${opts.remoteBlockIds.length} remote blocks`);
    try {
      checkRemoteSizes(this.#layout, opts.remote, this.#limits);
    } catch (e) {
      this.stats.recordFailedTransfer();
      throw fail('setup', e);
    }
    const key = engineKey(opts.remote);

    try {
      await this.#slot(key, opts.signal);
    } catch (e) {
      this.stats.recordFailedTransfer();
      throw fail('aborted', e);
    }
    const handles: XferHandle[] = [];
    let stage: PullFailure = 'handshake';
    let engine: RemoteEngine | undefined;
    const cached = this.#engines.has(key);
    let post: SpanLike | undefined;
    const connecting = this.#engineFor(opts.remote);
    try {
      const hs = child('kv.handshake', { 'nixl_node.cached': cached });
      try {
        engine = await connecting;
        hs.setAttribute('nixl_node.rtt_ms', engine.bestRttMs);
        hs.setAttribute('nixl_node.handshake_ms', engine.handshakeMs);
      } catch (e) {
        hs.fail(e);
        throw e;
      } finally {
        hs.end();
      }
      engine.pulls++;
      stage = 'setup';
      // Partial prefix hit: only the last blocks are missing here.
      const nRemote = Math.min(...[...engine.ranks.values()].flatMap((r) => r.counts));
      let remoteIds: number[];
      if (opts.remoteIdsAreLogical) {
        remoteIds = expandTail(opts.remoteBlockIds, engine.physicalBlocksPerLogical, localIds.length, nRemote);
      } else {
        remoteIds = Array.from(opts.remoteBlockIds);
        if (remoteIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nRemote))
          throw bad(`remote block ids must be integers in 0..${nRemote - 1}`);
        remoteIds = remoteIds.slice(remoteIds.length - localIds.length);
      }
      const notif = completionNotif(this.#wire, opts.requestId, this.#layout.tpSize, opts.remote.tpSize);
      // Aborted while it connected: post nothing (a transfer can finish before
      // anyone waits on it, and would then report success).
      if (opts.signal?.aborted)
        throw new NixlError('pull aborted before it was posted', 'NIXL_ERR_CANCELED', undefined, {
          cause: opts.signal.reason,
        });
      const t0 = performance.now();
      post = child('kv.post');
      let bytes = 0;
      for (const p of engine.reads) if (!p.read.notifyOnly) bytes += p.blockBytes * localIds.length;
      // The lease: never start a read that cannot end before the prefill may
      // free the blocks, never trust one that ended after.
      const lease = opts.lease && this.#leaseWindow(engine, opts.lease, opts.requestId);
      if (lease) {
        const expectMs = this.#rate > 0 ? bytes / this.#rate : 0;
        const left = lease.deadlineMs - t0;
        this.stats.recordLeaseCheck(left, lease.marginMs);
        if (left < lease.marginMs + expectMs) {
          stage = 'expired';
          throw new NixlError(
            `the prefill's lease on request '${opts.requestId}' ends in ${left.toFixed(1)} ms; a read needs ${expectMs.toFixed(1)} ms + ${lease.marginMs.toFixed(1)} ms margin: not started`,
            'NIXL_ERR_LEASE_EXPIRED',
          );
        }
      }
      if (localIds.length === 0) {
        // Full prefix hit: nothing to read, but the prefill side must free its blocks.
        for (const r of engine.ranks.values()) this.#notify(r.agentName, notif);
        return {
          requestId: opts.requestId,
          bytes: 0,
          descriptors: 0,
          postMs: 0,
          transferMs: 0,
          remoteRanks: [...new Set([...engine.ranks.values()].map((r) => r.rank))],
          coalesced: false,
        };
      }
      let descriptors = 0;
      let coalesced = false;
      const wantCoalesce = opts.coalesce ?? this.#opts.coalesce ?? false;
      const mt = this.#layout.memType ?? 'DRAM';
      for (const p of engine.reads) {
        if (p.read.notifyOnly) continue;
        const merged = wantCoalesce ? coalescedDescs(p.local, p.remote, localIds, remoteIds) : undefined;
        let h: XferHandle;
        if (merged) {
          h = this.#agent.initializeXfer(
            'READ',
            new DescList(merged.local, mt),
            new DescList(merged.remote, mt),
            p.rank.agentName,
            p.rank.board ? undefined : notif,
          );
          descriptors += merged.count;
          coalesced = true;
        } else {
          const regions = p.read.local.length;
          h = this.#agent.makePreppedXfer(
            'READ',
            this.#localDlist(p.read),
            blockDescIds(regionCounts(regions, this.#layout.numBlocks), localIds),
            p.rank.dlist,
            blockDescIds(p.rank.counts, remoteIds),
            // With a board the notification waits for the board's word.
            p.rank.board ? undefined : notif,
          );
          descriptors += regions * localIds.length;
        }
        handles.push(h);
        this.#xfers++;
        this.#agent.transfer(h);
      }
      for (const p of engine.reads) if (p.read.notifyOnly) this.#notify(p.rank.agentName, notif);
      span.setAttribute(
        'nixl_node.backend',
        [...new Set(handles.map((h) => this.#agent.queryXferBackend(h)))].join(','),
      );
      const postMs = performance.now() - t0;
      post.setAttribute('nixl_node.descriptors', descriptors);
      post.end();
      post = undefined;
      stage = 'transfer';
      const xfer = child('kv.transfer', {
        'nixl_node.bytes': bytes,
        'nixl_node.descriptors': descriptors,
        'nixl_node.remote_ranks': engine.plan.reads.map((x) => x.remoteRank).join(','),
        'nixl_node.engine': this.#agent.engine,
      });
      try {
        await Promise.all(handles.map((h) => this.#agent.wait(h, { timeoutMs: opts.timeoutMs, signal: opts.signal })));
      } catch (e) {
        xfer.fail(e);
        throw e;
      } finally {
        xfer.end();
      }
      const done = performance.now();
      const transferMs = done - t0;
      if (lease) {
        // Heartbeats sent while it ran may have moved the deadline.
        const { deadlineMs, marginMs } = this.#leaseWindow(engine, opts.lease!, opts.requestId);
        if (done + marginMs > deadlineMs) {
          stage = 'expired';
          throw new NixlError(
            `the read of request '${opts.requestId}' ended ${(done + marginMs - deadlineMs).toFixed(1)} ms too close to (or after) the prefill's lease end (margin ${marginMs.toFixed(1)} ms): its blocks may have been reused`,
            'NIXL_ERR_LEASE_EXPIRED',
          );
        }
      }
      // The prefill's own word: its board still says held, so nothing freed
      // the blocks before our read ended. Only then may it free them.
      const confirm = engine.reads.filter((p) => !p.read.notifyOnly && p.rank.board);
      if (confirm.length > 0) {
        const c = child('kv.confirm', { 'nixl_node.ranks': confirm.length });
        const verdicts = await Promise.all(
          confirm.map((p) =>
            this.#boards.verdict(p.rank.agentName, p.rank.board!, opts.requestId, opts.timeoutMs ?? 5000),
          ),
        ).finally(() => c.end());
        const i = verdicts.findIndex((v) => v !== 'held');
        if (i >= 0) {
          stage = 'expired';
          throw new NixlError(
            `prefill rank ${confirm[i].rank.rank} no longer held request '${opts.requestId}' when the read ended (${verdictText(verdicts[i])}): its blocks may have been reused`,
            'NIXL_ERR_LEASE_EXPIRED',
          );
        }
        const n = child('kv.notify', { 'nixl_node.ranks': confirm.length });
        for (const p of confirm) this.#notify(p.rank.agentName, notif);
        n.end();
      }
      if (transferMs > 0)
        this.#rate = this.#rate === 0 ? bytes / transferMs : 0.8 * this.#rate + 0.2 * (bytes / transferMs);
      this.stats.recordTransfer(bytes, descriptors, postMs, transferMs);
      return {
        requestId: opts.requestId,
        bytes,
        descriptors,
        postMs,
        transferMs,
        remoteRanks: engine.plan.reads.map((x) => x.remoteRank),
        coalesced,
      };
    } catch (e) {
      this.stats.recordFailedTransfer();
      const code = (e as NixlError)?.code;
      let kind: PullFailure = stage === 'handshake' && setupErrors.has(e as object) ? 'setup' : stage;
      if (code === 'NIXL_ERR_TIMEOUT' && stage === 'transfer') kind = 'timeout';
      else if (code === 'NIXL_ERR_CANCELED' && opts.signal?.aborted) kind = 'aborted';
      else if (code === 'NIXL_ERR_REMOTE_DISCONNECT') kind = 'peer-gone';
      // Making or posting the transfer found the remote side gone: every id
      // was checked here first, so NOT_FOUND there is not the request's
      // fault. NIXL answers so when the peer died (its connection is torn
      // down), and so does the engine when another pull dropped this one.
      else if (post !== undefined && code === 'NIXL_ERR_NOT_FOUND') kind = 'peer-gone';
      if (kind === 'expired') this.stats.recordExpired();
      post?.fail(e);
      post?.end();
      // A gone peer or a failed transfer: handshake afresh next time.
      if (engine && (kind === 'peer-gone' || kind === 'transfer')) this.#forget(engine, connecting);
      throw fail(kind, e);
    } finally {
      for (const h of handles) {
        try {
          this.#agent.releaseXferHandle(h);
        } catch {
          /* agent closed */
        }
        this.#xfers--;
      }
      if (engine) {
        engine.pulls--;
        if (engine.pulls === 0) engine.retired?.();
      }
      this.#release(key);
    }
  }

  /**
   * When the prefill may free a request's blocks, on our clock (ms), and the
   * margin a read must keep from it: its expiry time mapped through the
   * handshake's clock offset (or the lease from when it answered), moved
   * later by each heartbeat we sent for the request (vLLM's rule: max(old,
   * sent + 2/3 lease)).
   */
  #leaseWindow(engine: RemoteEngine, lease: RemoteLease, requestId: string): { deadlineMs: number; marginMs: number } {
    let deadlineMs =
      lease.remoteExpiryS != null && engine.clockOffsetS !== undefined
        ? (lease.remoteExpiryS - engine.clockOffsetS) * 1000
        : lease.issuedAtMs + lease.leaseMs;
    const sent = this.#held.get(engine.key)?.lastSentMs.get(requestId);
    if (sent !== undefined) deadlineMs = Math.max(deadlineMs, sent + Math.floor((lease.leaseMs * 2) / 3));
    const uncertainty = lease.remoteExpiryS != null && engine.clockOffsetS !== undefined ? engine.bestRttMs / 2 : 0;
    return { deadlineMs, marginMs: uncertainty + (this.#opts.leaseSlackMs ?? 50) };
  }

  /**
   * Pulls a request straight from the kv_transfer_params its prefill
   * returned (either profile's JSON, or parsed): handshakes with the ranks
   * they name, expands logical block ids on both sides, and keeps the
   * prefill's lease alive while the pull waits.
   */
  async pullFromParams(
    params: KvTransferParams | Record<string, unknown>,
    opts: PullFromParamsOptions,
  ): Promise<PullResult> {
    const issuedAtMs = opts.issuedAtMs ?? performance.now();
    const localLogical = Array.from(opts.localBlockIds);
    let p: KvTransferParams;
    try {
      if (this.#opts.paramsSecret !== undefined) {
        if (isParsed(params))
          throw new NixlError(
            'signed kv_transfer_params are checked as the prefill sent them: pass the JSON object, not parsed params',
            'NIXL_ERR_INVALID_PARAM',
          );
        verifyKvTransferParams(params, this.#opts.paramsSecret);
      }
      p = isParsed(params) ? params : parseKvTransferParams(params, this.#wire);
      checkRequestId(p.remoteRequestId);
      if (p.transferMode !== 'pull')
        throw new NixlError(
          `transfer_mode '${p.transferMode}' (prefill-initiated WRITE) is not supported by nixl-node`,
          'NIXL_ERR_NOT_SUPPORTED',
        );
      if (p.remoteBlockIds.length !== 1)
        throw new NixlError(
          `${p.remoteBlockIds.length} KV-cache groups: nixl-node pulls one group`,
          'NIXL_ERR_NOT_SUPPORTED',
        );
      const ratio = this.#layout.physicalBlocksPerLogical ?? 1;
      if (localLogical.length * ratio > this.#layout.numBlocks)
        throw new NixlError(
          `${localLogical.length} local logical blocks (x ${ratio}) exceed the local cache of ${this.#layout.numBlocks} blocks`,
          'NIXL_ERR_INVALID_PARAM',
        );
      checkRemoteSizes(this.#layout, endpointOf(p), this.#limits);
    } catch (e) {
      const err = e as NixlError;
      const id = isParsed(params) ? params.remoteRequestId : String(params.remote_request_id ?? '');
      const s = startSpan('kv.pull', { parent: opts.traceContext, attributes: { 'nixl_node.pull_failure': 'setup' } });
      s.fail(e);
      s.end();
      throw new PullError(
        `pull of request '${id}' from kv_transfer_params failed (setup): ${err.message}`,
        err.code ?? 'NIXL_ERR_INVALID_PARAM',
        'setup',
        id,
        localLogical,
        e,
      );
    }
    const ep = endpointOf(p);
    const release = this.holdRemote(ep, p.remoteRequestId);
    try {
      return await this.pullBlocks({
        remote: ep,
        requestId: p.remoteRequestId,
        localBlockIds: expand(localLogical, this.#layout.physicalBlocksPerLogical ?? 1),
        remoteBlockIds: p.remoteBlockIds[0],
        remoteIdsAreLogical: true,
        timeoutMs: opts.timeoutMs,
        signal: opts.signal,
        coalesce: opts.coalesce,
        traceContext: opts.traceContext,
        lease: {
          remoteExpiryS: p.remoteBlocksExpiryTime,
          issuedAtMs,
          leaseMs: this.#wire.heartbeats
            ? (this.#opts.kvLeaseMs ?? this.#wire.defaultLeaseMs)
            : this.#wire.defaultLeaseMs,
        },
      });
    } finally {
      release();
    }
  }

  /**
   * Keeps a prefill's lease on one of its requests alive while that request
   * waits here (v12: "HB:id1,id2" to every handshaked rank of the engine,
   * every sixth of the lease). Returns the function that stops it. A no-op
   * for profiles without heartbeats.
   */
  holdRemote(ep: RemoteEndpoint, remoteRequestId: string): () => void {
    if (!this.#wire.heartbeats || this.#closed) return () => {};
    const key = engineKey(ep);
    let h = this.#held.get(key);
    if (!h) {
      const every = Math.max(1, Math.floor((this.#opts.kvLeaseMs ?? 30_000) / 6));
      const entry = {
        ep,
        ids: new Map<string, number>(),
        lastSentMs: new Map<string, number>(),
        timer: setInterval(() => void this.#heartbeat(key), every),
      };
      entry.timer.unref();
      this.#held.set(key, entry);
      h = entry;
    }
    h.ids.set(remoteRequestId, (h.ids.get(remoteRequestId) ?? 0) + 1);
    const held = h;
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

  async #heartbeat(key: string): Promise<void> {
    const h = this.#held.get(key);
    if (!h || h.ids.size === 0) return;
    // Heartbeats trigger handshakes too (vLLM), so a prefill hears of a request before any READ.
    const engine = await this.#engineFor(h.ep).catch(() => undefined);
    if (!engine || engine.dropped) return;
    const ids = [...h.ids.keys()];
    const msg = `HB:${ids.join(',')}`;
    // A heartbeat counts towards a lease only once every rank took it.
    const sentAt = performance.now();
    let all = true;
    for (const r of engine.ranks.values()) all = this.#notify(r.agentName, msg) && all;
    if (all) for (const id of ids) if (h.ids.has(id)) h.lastSentMs.set(id, sentAt);
    for (const id of ids) this.#pullSpans.get(id)?.addEvent('heartbeat', { 'nixl_node.delivered': all });
    this.heartbeatsSent++;
  }

  /** v12: the prefill's clock minus ours, seconds (lowest-RTT handshake sample). */
  async clockOffset(ep: RemoteEndpoint): Promise<number | undefined> {
    return (await this.#engineFor(ep)).clockOffsetS;
  }

  #notify(agentName: string, msg: string): boolean {
    try {
      this.#agent.sendNotif(agentName, msg);
      return true;
    } catch {
      // The prefill side frees the blocks after its timeout instead.
      this.stats.recordFailedNotification();
      return false;
    }
  }

  /** Handshake time of a connected engine, ms. */
  async handshakeMs(ep: RemoteEndpoint): Promise<number> {
    return (await this.#engineFor(ep)).handshakeMs;
  }

  /** What the puller holds right now (tests check nothing leaks). */
  resources(): {
    xferHandles: number;
    localDlists: number;
    engines: number;
    activePulls: number;
    remoteAgents: number;
  } {
    let active = 0;
    for (const q of this.#slots.values()) active += q.active;
    return {
      xferHandles: this.#xfers,
      localDlists: this.#localDlists.size,
      engines: this.#engines.size,
      activePulls: active,
      remoteAgents: this.#agentUsers.size,
    };
  }

  /** Stops: in-flight pulls fail, remote agents are forgotten. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const h of this.#held.values()) clearInterval(h.timer);
    this.#held.clear();
    for (const p of [...this.#engines.values()]) {
      const engine = await p.catch(() => undefined);
      if (engine) this.#forget(engine, p);
    }
    for (const d of this.#localDlists.values()) {
      try {
        this.#agent.releaseDlistHandle(d);
      } catch {
        /* agent closed */
      }
    }
    this.#localDlists.clear();
    this.#boards.close();
    this.#hs.close();
  }
}

/**
 * One cached connection per prefill address *and* what the request says of
 * it: a request naming another tp_size or engine id handshakes afresh and is
 * checked against what answers, instead of reusing (and trusting) a plan made
 * for different parameters.
 */
function engineKey(ep: RemoteEndpoint): string {
  return `${ep.host}:${ep.port}:${ep.dpRank ?? 0}|${ep.engineId ?? ''}|${ep.tpSize}x${ep.ppSize ?? 1}x${ep.dcpSize ?? 1}`;
}

/**
 * A request id becomes part of notifications ("<id>:<n>", "HB:<id>,<id>"):
 * one that could read as a heartbeat, a list or another message is refused.
 */
function checkRequestId(id: string): void {
  // biome-ignore lint/suspicious/noControlCharactersInRegex: the check is for control characters
  if (id.length === 0 || id.length > 256 || id.startsWith('HB:') || /[,\s\x00-\x1f\x7f]/.test(id))
    throw new NixlError(
      `remote_request_id ${JSON.stringify(id.slice(0, 80))} cannot be used in a notification (empty, over 256 characters, starts with 'HB:', or holds ',' or white space)`,
      'NIXL_ERR_INVALID_PARAM',
    );
}

/** A lease board a prefill's metadata names, if it is one we can read. */
function usableBoard(b: bigint[] | undefined): readonly bigint[] | undefined {
  if (b?.length !== 2) return undefined;
  return b[1] >= BigInt(PROBE) && b[1] <= 1n << 24n ? b : undefined;
}

const RELEASED = ['free', 'held', 'freed after its reads', 'its lease ran out', 'released: no decode would read it'];

function verdictText(v: 'held' | SlotState | 'missing'): string {
  if (v === 'missing') return 'not on its lease board: released long ago, or never held';
  return typeof v === 'number' ? (RELEASED[v] ?? `board state ${v}`) : v;
}

/** Runs a synchronous check; what it throws fails the pull as 'setup', not 'handshake'. */
function asSetup<T>(f: () => T): T {
  try {
    return f();
  } catch (e) {
    if (typeof e === 'object' && e !== null) setupErrors.add(e);
    throw e;
  }
}

/** fn over items with at most `limit` running at once; rejects on the first failure (starting no more). */
async function mapLimit<T, R>(items: readonly T[], limit: number, fn: (t: T) => Promise<R>): Promise<R[]> {
  const out = new Array<R>(items.length);
  let next = 0;
  let failed = false;
  const run = async () => {
    while (!failed && next < items.length) {
      const i = next++;
      try {
        out[i] = await fn(items[i]);
      } catch (e) {
        failed = true;
        throw e;
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, run));
  return out;
}

function isParsed(p: KvTransferParams | Record<string, unknown>): p is KvTransferParams {
  return 'remoteBlockIds' in p;
}

function endpointOf(p: KvTransferParams): RemoteEndpoint {
  // remote_port already includes the prefill's DP index.
  return {
    host: p.remoteHost,
    port: p.remotePort,
    tpSize: p.tpSize,
    ppSize: p.ppSize,
    dcpSize: p.dcpSize,
    engineId: p.remoteEngineId,
  };
}

/** vLLM's _logical_to_kernel_block_ids: logical id b covers kernel blocks b*r .. b*r + r-1. */
export function expand(logical: ArrayLike<number>, r: number): number[] {
  if (r === 1) return Array.from(logical);
  const out: number[] = [];
  for (let i = 0; i < logical.length; i++) for (let j = 0; j < r; j++) out.push(logical[i] * r + j);
  return out;
}
