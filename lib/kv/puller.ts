// The decode side: handshake with the prefill ranks this rank reads from,
// prepare descriptor lists once per remote engine and rank, and pull a
// request's blocks with one call.
import type { NixlAgent, XferHandle, DlistHandle } from '../agent';
import { DescList } from '../descriptors';
import { NixlError } from '../errors';
import { createHandshake } from '../handshake';
import type { HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../handshake/types';
import type { NixlAgentMetadata } from '../handshake/codec';
import { type BlockSlices, allBlockDescs, blockDescIds, coalescedDescs } from './descs';
import { checkLayout, type KvLayout } from './layout';
import { KvStats } from './stats';
import { type ReadPlan, type RankRead, planReads, targetRemoteRanks } from './tp';

export interface RemoteEndpoint {
  host: string;
  /** The prefill engine's advertised side-channel base port. */
  port: number;
  tpSize: number;
  dpRank?: number;
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

export interface KvPullerOptions {
  agent: NixlAgent;
  layout: KvLayout;
  handshake?: HandshakeStrategy | HandshakeMethod;
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
  rank: number;
  agentName: string;
  meta: NixlAgentMetadata;
  dlist: DlistHandle;
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
  plan: ReadPlan;
  ranks: Map<number, RemoteRank>;
  reads: PreparedRead[];
  numBlocks: number;
  handshakeMs: number;
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
  #active = 0;
  #xfers = 0;
  #closed = false;

  constructor(opts: KvPullerOptions) {
    checkLayout(opts.layout);
    this.#agent = opts.agent;
    this.#layout = opts.layout;
    this.#opts = opts;
    this.#hs = typeof opts.handshake === 'object' ? opts.handshake : createHandshake(opts.handshake);
  }

  /** Handshakes and prepares descriptor lists (done once per remote engine; pulls call it). */
  connect(ep: RemoteEndpoint): Promise<RemoteEngine> {
    const key = `${ep.host}:${ep.port}:${ep.dpRank ?? 0}`;
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
    const wanted = targetRemoteRanks(this.#layout.tpSize, this.#layout.tpRank, ep.tpSize);
    const fetched = await Promise.all(
      wanted.map((tpRank) =>
        this.#hs.fetch({
          host: ep.host,
          port: ep.port,
          dpRank: ep.dpRank,
          tpRank,
          expectedHash: this.#opts.expectedHash,
          timeoutMs: this.#opts.handshakeTimeoutMs,
          tls: this.#opts.tls,
          bearerToken: this.#opts.bearerToken,
        }),
      ),
    );
    const metas = fetched.map((f) => f.metadata);
    // Every rank must agree with us (and with each other) before anything is registered.
    const plan = planReads(this.#layout, ep.tpSize, metas[0]);
    for (const m of metas.slice(1)) {
      planReads(this.#layout, ep.tpSize, m);
      if (m.engineId !== metas[0].engineId || m.numBlocks !== metas[0].numBlocks) {
        throw new NixlError(
          `remote ranks disagree on engine id or num_blocks (${metas[0].engineId}/${metas[0].numBlocks} vs ${m.engineId}/${m.numBlocks})`,
          'NIXL_ERR_MISMATCH',
        );
      }
    }
    const ranks = new Map<number, RemoteRank>();
    const reads: PreparedRead[] = [];
    const added: string[] = [];
    const dlists: DlistHandle[] = [];
    try {
      wanted.forEach((rank, i) => {
        const meta = metas[i];
        const read = plan.reads[i];
        const local = this.#localSlices(read);
        const remote: BlockSlices = {
          baseAddrs: meta.kvCachesBaseAddr,
          strides: meta.blockLens,
          offsets: read.remoteOffset,
          lens: local.lens,
          devId: meta.deviceId,
        };
        const agentName = this.#agent.addRemoteAgent(meta.agentMetadata);
        added.push(agentName);
        const dlist = this.#agent.prepXferDlist(
          agentName,
          new DescList(allBlockDescs(remote, meta.numBlocks), this.#layout.memType ?? 'DRAM'),
        );
        dlists.push(dlist);
        const r = { rank, agentName, meta, dlist };
        ranks.set(rank, r);
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
      engineId: metas[0].engineId,
      plan,
      ranks,
      reads,
      numBlocks: metas[0].numBlocks,
      handshakeMs: performance.now() - t0,
      dropped: false,
    };
  }

  #localSlices(read: RankRead): BlockSlices {
    const l = this.#layout;
    return {
      baseAddrs: l.baseAddrs,
      strides: l.blockLens,
      offsets: read.local.map((s) => s.offset),
      lens: read.local.map((s) => s.len),
      devId: l.deviceId ?? 0,
    };
  }

  #localDlist(read: RankRead): DlistHandle {
    const key = read.local.map((s) => `${s.offset}+${s.len}`).join(',');
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
    if (localIds.length > remoteIds.length)
      throw bad(`${localIds.length} local blocks but only ${remoteIds.length} remote blocks`);
    const nLocal = this.#layout.numBlocks;
    if (localIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nLocal))
      throw bad(`local block ids must be integers in 0..${nLocal - 1}`);
    // Partial prefix hit: only the last blocks are missing here.
    if (localIds.length < remoteIds.length) remoteIds = remoteIds.slice(remoteIds.length - localIds.length);

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
      const nRemote = engine.numBlocks;
      if (remoteIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nRemote))
        throw bad(`remote block ids must be integers in 0..${nRemote - 1}`);
      const notif = `${opts.requestId}:${this.#layout.tpSize}`;
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
          remoteRanks: [...engine.ranks.keys()],
          coalesced: false,
        };
      }
      const regions = this.#layout.baseAddrs.length;
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
          h = this.#agent.makePreppedXfer(
            'READ',
            this.#localDlist(p.read),
            blockDescIds(regions, this.#layout.numBlocks, localIds),
            p.rank.dlist,
            blockDescIds(regions, nRemote, remoteIds),
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
