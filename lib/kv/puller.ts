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
import { KvStats } from './stats';
import { type RankRead, type ReadPlan, completionNotif, handshakeTargets, planReads } from './tp';

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

export type PullFailure = 'handshake' | 'setup' | 'transfer' | 'timeout' | 'peer-gone' | 'aborted';

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
}

export interface PullResult {
  requestId: string;
  bytes: number;
  descriptors: number;
  postMs: number;
  transferMs: number;
  remoteRanks: number[];
  coalesced: boolean;
}

export interface PullFromParamsOptions {
  /** Our logical block ids (one KV-cache group), expanded by layout.physicalBlocksPerLogical. */
  localBlockIds: ArrayLike<number>;
  timeoutMs?: number;
  signal?: AbortSignal;
  coalesce?: boolean;
}

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
  /** Pulls in flight at once, across requests. Default 16. */
  maxConcurrent?: number;
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
}

interface RemoteRank {
  ppRank: number;
  rank: number;
  agentName: string;
  meta: NixlAgentMetadata;
  dlist: DlistHandle;
  /** Blocks per region of its prepped list. */
  counts: readonly number[];
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
  /** Its remote agents were removed and dlists released (once). */
  dropped: boolean;
}

// Errors of the setup half of a connect (addRemoteAgent, prepXferDlist): the
// handshake itself worked, so the pull fails as kind 'setup'.
const setupErrors = new WeakSet<object>();

export class KvPuller {
  readonly stats = new KvStats();
  readonly #agent: NixlAgent;
  readonly #layout: KvLayout;
  readonly #hs: HandshakeStrategy;
  readonly #opts: KvPullerOptions;
  readonly #engines = new Map<string, Promise<RemoteEngine>>();
  readonly #localDlists = new Map<string, DlistHandle>();
  readonly #waiting: Array<() => void> = [];
  readonly #wire: WireProfile;
  /** Remote requests waiting here, per engine: heartbeats keep their leases. */
  readonly #held = new Map<string, { ep: RemoteEndpoint; ids: Map<string, number>; timer: NodeJS.Timeout }>();
  heartbeatsSent = 0;
  #active = 0;
  #xfers = 0;
  #closed = false;

  constructor(opts: KvPullerOptions) {
    checkLayout(opts.layout);
    this.#agent = opts.agent;
    this.#layout = opts.layout;
    this.#opts = opts;
    this.#hs = typeof opts.handshake === 'object' ? opts.handshake : createHandshake(opts.handshake);
    this.#wire = wireProfile(opts.wire);
  }

  get wire(): WireProfile {
    return this.#wire;
  }

  /** Handshakes and prepares descriptor lists (done once per remote engine; pulls call it). */
  connect(ep: RemoteEndpoint): Promise<RemoteEngine> {
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
    const targets = handshakeTargets(this.#layout.tpSize, this.#layout.tpRank, ep);
    const fetched = await Promise.all(
      targets.map((t) =>
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
        }),
      ),
    );
    const metas = fetched.map((f) => f.metadata);
    const first = metas[0];
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

    const ranks = new Map<string, RemoteRank>();
    const reads: PreparedRead[] = [];
    const added: string[] = [];
    const dlists: DlistHandle[] = [];
    try {
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
        const agentName = this.#agent.addRemoteAgent(meta.agentMetadata);
        added.push(agentName);
        const dlist = this.#agent.prepXferDlist(
          agentName,
          new DescList(allBlockDescs(remote, counts), this.#layout.memType ?? 'DRAM'),
        );
        dlists.push(dlist);
        const r: RemoteRank = { ppRank: t.ppRank, rank: t.tpRank, agentName, meta, dlist, counts };
        ranks.set(`${t.ppRank}:${t.tpRank}`, r);
        if (!read.notifyOnly) this.#localDlist(read);
        reads.push({ read, rank: r, local, remote, blockBytes: local.lens.reduce((a, b) => a + b, 0) });
      });
    } catch (e) {
      // Undo everything this connect loaded, so that the next handshake
      // (a corrected or restarted prefill with the same agent names) loads.
      for (const d of dlists) this.#quietly(() => this.#agent.releaseDlistHandle(d));
      for (const n of added) this.#quietly(() => this.#agent.removeRemoteAgent(n));
      if (typeof e === 'object' && e !== null) setupErrors.add(e);
      throw e;
    }
    return {
      key,
      engineId: first.engineId,
      plan: plans[0],
      ranks,
      reads,
      numBlocks: first.numBlocks,
      physicalBlocksPerLogical: first.physicalBlocksPerLogical,
      handshakeMs: performance.now() - t0,
      clockOffsetS: best?.clockOffsetS,
      dropped: false,
    };
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
  #forget(engine: RemoteEngine, promise: Promise<RemoteEngine>): void {
    if (this.#engines.get(engine.key) === promise) this.#engines.delete(engine.key);
    if (engine.dropped) return;
    engine.dropped = true;
    for (const r of engine.ranks.values()) {
      this.#quietly(() => this.#agent.releaseDlistHandle(r.dlist));
      this.#quietly(() => this.#agent.removeRemoteAgent(r.agentName));
    }
  }

  async #slot(signal?: AbortSignal): Promise<void> {
    const max = this.#opts.maxConcurrent ?? 16;
    if (this.#active < max) {
      this.#active++;
      return;
    }
    await new Promise<void>((resolve, reject) => {
      const go = () => {
        signal?.removeEventListener('abort', onAbort);
        this.#active++;
        resolve();
      };
      const onAbort = () => {
        const i = this.#waiting.indexOf(go);
        if (i >= 0) this.#waiting.splice(i, 1);
        reject(new NixlError('pull aborted while queued', 'NIXL_ERR_CANCELED', undefined, { cause: signal?.reason }));
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      this.#waiting.push(go);
    });
  }

  #release(): void {
    this.#active--;
    this.#waiting.shift()?.();
  }

  async pullBlocks(opts: PullOptions): Promise<PullResult> {
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
    let remoteIds = Array.from(opts.remoteBlockIds);
    const bad = (m: string) => fail('setup', new NixlError(m, 'NIXL_ERR_INVALID_PARAM'));
    const sizeCheck = () => {
      if (localIds.length > remoteIds.length)
        throw bad(`${localIds.length} local blocks but only ${remoteIds.length} remote blocks`);
    };
    if (!opts.remoteIdsAreLogical) sizeCheck();
    const nLocal = this.#layout.numBlocks;
    if (localIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nLocal))
      throw bad(`local block ids must be integers in 0..${nLocal - 1}`);
    // Partial prefix hit: only the last blocks are missing here.

    try {
      await this.#slot(opts.signal);
    } catch (e) {
      this.stats.recordFailedTransfer();
      throw fail('aborted', e);
    }
    const handles: XferHandle[] = [];
    let stage: PullFailure = 'handshake';
    let engine: RemoteEngine | undefined;
    const connecting = this.connect(opts.remote);
    try {
      engine = await connecting;
      stage = 'setup';
      if (opts.remoteIdsAreLogical) {
        remoteIds = expand(remoteIds, engine.physicalBlocksPerLogical);
        sizeCheck();
      }
      // Partial prefix hit: only the last blocks are missing here.
      if (localIds.length < remoteIds.length) remoteIds = remoteIds.slice(remoteIds.length - localIds.length);
      const nRemote = Math.min(...[...engine.ranks.values()].flatMap((r) => r.counts));
      if (remoteIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nRemote))
        throw bad(`remote block ids must be integers in 0..${nRemote - 1}`);
      const notif = completionNotif(this.#wire, opts.requestId, this.#layout.tpSize, opts.remote.tpSize);
      const t0 = performance.now();
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
      let bytes = 0;
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
            notif,
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
            notif,
          );
          descriptors += regions * localIds.length;
        }
        handles.push(h);
        this.#xfers++;
        this.#agent.transfer(h);
        bytes += p.blockBytes * localIds.length;
      }
      for (const p of engine.reads) if (p.read.notifyOnly) this.#notify(p.rank.agentName, notif);
      const postMs = performance.now() - t0;
      stage = 'transfer';
      await Promise.all(handles.map((h) => this.#agent.wait(h, { timeoutMs: opts.timeoutMs, signal: opts.signal })));
      const transferMs = performance.now() - t0;
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
      this.#release();
    }
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
    const localLogical = Array.from(opts.localBlockIds);
    let p: KvTransferParams;
    try {
      p = isParsed(params) ? params : parseKvTransferParams(params, this.#wire);
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
    } catch (e) {
      const err = e as NixlError;
      const id = isParsed(params) ? params.remoteRequestId : String(params.remote_request_id ?? '');
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
      const entry = { ep, ids: new Map<string, number>(), timer: setInterval(() => void this.#heartbeat(key), every) };
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
      else held.ids.delete(remoteRequestId);
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
    const engine = await this.connect(h.ep).catch(() => undefined);
    if (!engine || engine.dropped) return;
    const msg = `HB:${[...h.ids.keys()].join(',')}`;
    for (const r of engine.ranks.values()) this.#notify(r.agentName, msg);
    this.heartbeatsSent++;
  }

  /** v12: the prefill's clock minus ours, seconds (lowest-RTT handshake sample). */
  async clockOffset(ep: RemoteEndpoint): Promise<number | undefined> {
    return (await this.connect(ep)).clockOffsetS;
  }

  #notify(agentName: string, msg: string): void {
    try {
      this.#agent.sendNotif(agentName, msg);
    } catch {
      // The prefill side frees the blocks after its timeout instead.
      this.stats.recordFailedNotification();
    }
  }

  /** Handshake time of a connected engine, ms. */
  async handshakeMs(ep: RemoteEndpoint): Promise<number> {
    return (await this.connect(ep)).handshakeMs;
  }

  /** What the puller holds right now (tests check nothing leaks). */
  resources(): { xferHandles: number; localDlists: number; engines: number; activePulls: number } {
    return {
      xferHandles: this.#xfers,
      localDlists: this.#localDlists.size,
      engines: this.#engines.size,
      activePulls: this.#active,
    };
  }

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
    this.#hs.close();
  }
}

function engineKey(ep: RemoteEndpoint): string {
  return `${ep.host}:${ep.port}:${ep.dpRank ?? 0}`;
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
