// One pull as a pipeline of named stages. Each stage owns its span and the
// kind a failure in it gets (PullFailure), so a failure is classified where
// it happens:
//
//   check     the local ids and whether the puller is open      setup
//   admit     the request's remote sizes; a pull slot           setup; aborted
//   handshake the remote engine (span kv.handshake)             handshake or setup (engine-connect.ts)
//   plan      remote ids, the completion notification           setup
//   post      the lease before the read; post the READs         expired; setup (span kv.post)
//   transfer  wait for the READs (span kv.transfer)             transfer or timeout
//   lease     the lease after the read                          expired
//   confirm   the lease boards, then notify (kv.confirm/notify) transfer or timeout; expired
//
// In every stage a cancel after the caller's abort is 'aborted' and a remote
// disconnect is 'peer-gone'; while posting, NOT_FOUND from the engine (every
// id was checked before) means the peer went away too.
import type { NixlAgent, XferHandle } from '../../agent';
import { DescList } from '../../descriptors';
import { NixlError } from '../../errors';
import type { WireProfile } from '../../handshake/model';
import { type SpanLike, startSpan } from '../../tracing';
import { blockDescIds, coalescedDescs, regionCounts } from '../descs';
import type { ConnectAttempt, RemoteEngine } from '../remote-engines';
import type { PeerEngines } from '../peers';
import type { KvLayout } from '../layout';
import type { BoardReader, SlotState } from '../lease-board';
import type { LeaseKeeper } from '../leases';
import { type PullLimits, checkRemoteSizes, expandTail } from '../limits';
import type { LocalDlists } from '../local-dlists';
import type { EngineSlots } from './slots';
import { type PullFailure, type PullOptions, type PullResult, PullError, pullError } from './types';
import type { KvStats } from '../stats';
import { completionNotif } from '../tp';
import { type PreparedRead, engineKey } from '../engine-connect';
import { awaitConnect } from '../connect-wait';

/** What every pull of one puller shares. @internal */
export interface PullDeps {
  agent: NixlAgent;
  layout: KvLayout;
  wire: WireProfile;
  limits: Required<PullLimits>;
  /** The puller's coalescing default. */
  coalesce: boolean;
  engines: PeerEngines;
  local: LocalDlists;
  /** Confirm reads against the lease boards remote engines name (KvPullerOptions.leaseBoards). */
  leaseBoards: boolean;
  slots: EngineSlots;
  leases: LeaseKeeper<PullOptions['remote'], RemoteEngine>;
  boards: BoardReader;
  stats: KvStats;
  notify: (agentName: string, msg: string) => boolean;
  isClosed: () => boolean;
  /** Transfer handles held; bytes per ms of recent pulls (EWMA), what a read is expected to take. */
  live: { xfers: number; rate: number };
}

/** The READs of one pull, posted. */
interface Posted {
  t0: number;
  bytes: number;
  descriptors: number;
  coalesced: boolean;
  postMs: number;
}

type Classify = (e: unknown) => PullFailure;

const RELEASED = ['free', 'held', 'freed after its reads', 'its lease ran out', 'released: no decode would read it'];

function verdictText(v: 'held' | SlotState | 'missing'): string {
  if (v === 'missing') return 'not on its lease board: released long ago, or never held';
  return typeof v === 'number' ? (RELEASED[v] ?? `board state ${v}`) : v;
}

const codeOf = (e: unknown): string | undefined => (e as NixlError)?.code;

/** One pull of one request, run once. @internal */
export class PullRun {
  readonly #d: PullDeps;
  readonly #o: PullOptions;
  readonly #span: SpanLike;
  readonly #localIds: number[];
  readonly #key: string;
  readonly #handles: XferHandle[] = [];
  #attempt: ConnectAttempt | undefined;
  #engine: RemoteEngine | undefined;

  constructor(deps: PullDeps, opts: PullOptions, span: SpanLike) {
    this.#d = deps;
    this.#o = opts;
    this.#span = span;
    this.#localIds = Array.from(opts.localBlockIds);
    this.#key = engineKey(opts.remote);
  }

  async run(): Promise<PullResult> {
    this.#check();
    await this.#admit();
    try {
      const engine = await this.#handshake();
      const { remoteIds, notif } = this.#plan(engine);
      const posted = this.#post(engine, remoteIds, notif);
      if (!posted) return this.#nothingToRead(engine, notif);
      await this.#transfer(engine, posted);
      const done = performance.now();
      this.#leaseAfter(engine, done);
      await this.#confirm(engine, notif);
      return this.#record(engine, posted, done - posted.t0);
    } catch (e) {
      throw this.#failed(e);
    } finally {
      this.#cleanUp();
    }
  }

  #fail(kind: PullFailure, e: unknown): PullError {
    return pullError(kind, e, this.#o.requestId, this.#localIds);
  }

  /** Runs f; what it throws fails the pull as `classify` says. */
  #as<T>(classify: PullFailure | Classify, f: () => T): T {
    const kindOf = typeof classify === 'string' ? () => classify : classify;
    try {
      const r = f();
      if (r instanceof Promise) return r.catch((e: unknown) => Promise.reject(this.#fail(kindOf(e), e))) as T;
      return r;
    } catch (e) {
      throw this.#fail(kindOf(e), e);
    }
  }

  /** The rules of every stage after admission, else undefined. */
  #common(e: unknown): PullFailure | undefined {
    const code = codeOf(e);
    if (code === 'NIXL_ERR_CANCELED' && this.#o.signal?.aborted) return 'aborted';
    if (code === 'NIXL_ERR_REMOTE_DISCONNECT') return 'peer-gone';
    return undefined;
  }

  #child(name: string, attributes?: Record<string, string | number | boolean>): SpanLike {
    return startSpan(name, { parent: this.#span.context, attributes });
  }

  /** check: the puller is open and the local ids fit the local cache. */
  #check(): void {
    if (this.#d.isClosed()) throw this.#fail('setup', new NixlError('puller is closed', 'NIXL_ERR_NOT_ALLOWED'));
    const bad = (m: string) => this.#fail('setup', new NixlError(m, 'NIXL_ERR_INVALID_PARAM'));
    const ids = this.#localIds;
    const nLocal = this.#d.layout.numBlocks;
    if (ids.length > nLocal) throw bad(`${ids.length} local blocks asked, the local cache has ${nLocal}`);
    if (ids.some((b) => !Number.isInteger(b) || b < 0 || b >= nLocal))
      throw bad(`local block ids must be integers in 0..${nLocal - 1}`);
    if (!this.#o.remoteIdsAreLogical && ids.length > this.#o.remoteBlockIds.length)
      throw bad(`${ids.length} local blocks but only ${this.#o.remoteBlockIds.length} remote blocks`);
  }

  /** admit: what the request sizes of the remote engine, then a slot for that engine. */
  async #admit(): Promise<void> {
    try {
      this.#as('setup', () => checkRemoteSizes(this.#d.layout, this.#o.remote, this.#d.limits));
      await this.#as('aborted', () => this.#d.slots.acquire(this.#key, this.#o.signal));
    } catch (e) {
      this.#d.stats.recordFailedTransfer();
      throw e;
    }
  }

  /** handshake: the connected remote engine (cached, or connected now). */
  async #handshake(): Promise<RemoteEngine> {
    const cached = this.#d.engines.has(this.#o.remote);
    const attempt = this.#d.engines.attempt(this.#o.remote, this.#o.handshake);
    this.#attempt = attempt;
    const span = this.#child('kv.handshake', { 'nixl_node.cached': cached });
    try {
      const engine = await this.#as(
        (e) => this.#common(e) ?? attempt.steps.failedAs ?? 'handshake',
        () => awaitConnect(attempt.promise, this.#o.signal, this.#o.handshake),
      );
      span.setAttribute('nixl_node.rtt_ms', engine.bestRttMs);
      span.setAttribute('nixl_node.handshake_ms', engine.handshakeMs);
      this.#engine = engine;
      engine.pulls++;
      return engine;
    } catch (e) {
      span.fail(e);
      throw e;
    } finally {
      span.end();
    }
  }

  /** plan: the remote ids to read (a partial prefix hit reads the last ones) and the completion notification. */
  #plan(engine: RemoteEngine): { remoteIds: number[]; notif: string } {
    return this.#as(
      (e) => this.#common(e) ?? 'setup',
      () => {
        const o = this.#o;
        const n = this.#localIds.length;
        const nRemote = Math.min(...[...engine.ranks.values()].flatMap((r) => r.counts));
        let remoteIds: number[];
        if (o.remoteIdsAreLogical) {
          const head = o.remoteRange === 'head';
          remoteIds = expandTail(o.remoteBlockIds, engine.physicalBlocksPerLogical, n, nRemote, undefined, head);
        } else {
          remoteIds = Array.from(o.remoteBlockIds);
          if (remoteIds.some((b) => !Number.isInteger(b) || b < 0 || b >= nRemote))
            throw new NixlError(`remote block ids must be integers in 0..${nRemote - 1}`, 'NIXL_ERR_INVALID_PARAM');
          remoteIds = o.remoteRange === 'head' ? remoteIds.slice(0, n) : remoteIds.slice(remoteIds.length - n);
        }
        const notif = completionNotif(this.#d.wire, o.requestId, this.#d.layout.tpSize, o.remote.tpSize);
        // Aborted while it connected: post nothing (a transfer can finish
        // before anyone waits on it, and would then report success).
        if (o.signal?.aborted)
          throw new NixlError('pull aborted before it was posted', 'NIXL_ERR_CANCELED', undefined, {
            cause: o.signal.reason,
          });
        return { remoteIds, notif };
      },
    );
  }

  /**
   * post: checks the lease (never start a read that cannot end before the
   * prefill may free the blocks), then posts one READ per remote rank read
   * from. Undefined when there is nothing to read (a full prefix hit).
   */
  #post(engine: RemoteEngine, remoteIds: number[], notif: string): Posted | undefined {
    const t0 = performance.now();
    const span = this.#child('kv.post');
    let bytes = 0;
    for (const p of engine.reads) if (!p.read.notifyOnly) bytes += p.blockBytes * this.#localIds.length;
    try {
      this.#leaseBefore(engine, bytes, t0);
      if (this.#localIds.length === 0) return undefined;
      const posted = this.#as(
        (e) => this.#common(e) ?? (codeOf(e) === 'NIXL_ERR_NOT_FOUND' ? 'peer-gone' : 'setup'),
        () => this.#postReads(engine, remoteIds, notif),
      );
      const postMs = performance.now() - t0;
      span.setAttribute('nixl_node.descriptors', posted.descriptors);
      return { t0, bytes, postMs, ...posted };
    } catch (e) {
      span.fail(e);
      throw e;
    } finally {
      span.end();
    }
  }

  #leaseBefore(engine: RemoteEngine, bytes: number, t0: number): void {
    if (!this.#o.lease) return;
    const { deadlineMs, marginMs } = this.#d.leases.window(engine, this.#o.lease, this.#o.requestId);
    const rate = this.#d.live.rate;
    const expectMs = rate > 0 ? bytes / rate : 0;
    const left = deadlineMs - t0;
    this.#d.stats.recordLeaseCheck(left, marginMs);
    if (left < marginMs + expectMs)
      throw this.#fail(
        'expired',
        new NixlError(
          `the prefill's lease on request '${this.#o.requestId}' ends in ${left.toFixed(1)} ms; a read needs ${expectMs.toFixed(1)} ms + ${marginMs.toFixed(1)} ms margin: not started`,
          'NIXL_ERR_LEASE_EXPIRED',
        ),
      );
  }

  #postReads(engine: RemoteEngine, remoteIds: number[], notif: string): { descriptors: number; coalesced: boolean } {
    const { agent, layout } = this.#d;
    const localIds = this.#localIds;
    let descriptors = 0;
    let coalesced = false;
    const wantCoalesce = this.#o.coalesce ?? this.#d.coalesce;
    const mt = layout.memType ?? 'DRAM';
    for (const p of engine.reads) {
      if (p.read.notifyOnly) continue;
      // With a board the notification waits for the board's word.
      const notifMsg = this.#boardOf(p) ? undefined : notif;
      const merged = wantCoalesce ? coalescedDescs(p.local, p.remote, localIds, remoteIds) : undefined;
      let h: XferHandle;
      if (merged) {
        const local = new DescList(merged.local, mt);
        h = agent.initializeXfer('READ', local, new DescList(merged.remote, mt), p.rank.agentName, notifMsg);
        descriptors += merged.count;
        coalesced = true;
      } else {
        const regions = p.read.local.length;
        const localDescs = blockDescIds(regionCounts(regions, layout.numBlocks), localIds);
        const remoteDescs = blockDescIds(p.rank.counts, remoteIds);
        h = agent.makePreppedXfer('READ', this.#d.local.get(p.read), localDescs, p.rank.dlist, remoteDescs, notifMsg);
        descriptors += regions * localIds.length;
      }
      this.#handles.push(h);
      this.#d.live.xfers++;
      agent.transfer(h);
    }
    for (const p of engine.reads) if (p.read.notifyOnly) this.#d.notify(p.rank.agentName, notif);
    this.#span.setAttribute(
      'nixl_node.backend',
      [...new Set(this.#handles.map((h) => agent.queryXferBackend(h)))].join(','),
    );
    return { descriptors, coalesced };
  }

  /** The lease board a read is confirmed against, if the remote rank has one and the puller reads boards. */
  #boardOf(p: PreparedRead): readonly bigint[] | undefined {
    return this.#d.leaseBoards ? p.rank.board : undefined;
  }

  /** Full prefix hit: nothing to read, but the prefill side must free its blocks. */
  #nothingToRead(engine: RemoteEngine, notif: string): PullResult {
    for (const r of engine.ranks.values()) this.#d.notify(r.agentName, notif);
    return {
      requestId: this.#o.requestId,
      bytes: 0,
      descriptors: 0,
      postMs: 0,
      transferMs: 0,
      remoteRanks: [...new Set([...engine.ranks.values()].map((r) => r.rank))],
      coalesced: false,
    };
  }

  /** A wait in the transfer or confirm stage. */
  #waitKind = (e: unknown): PullFailure =>
    codeOf(e) === 'NIXL_ERR_TIMEOUT' ? 'timeout' : (this.#common(e) ?? 'transfer');

  /** transfer: waits for every posted READ. */
  async #transfer(engine: RemoteEngine, posted: Posted): Promise<void> {
    const span = this.#child('kv.transfer', {
      'nixl_node.bytes': posted.bytes,
      'nixl_node.descriptors': posted.descriptors,
      'nixl_node.remote_ranks': engine.plan.reads.map((x) => x.remoteRank).join(','),
      'nixl_node.engine': this.#d.agent.engine,
    });
    const { timeoutMs, signal } = this.#o;
    try {
      await this.#as(this.#waitKind, () =>
        Promise.all(this.#handles.map((h) => this.#d.agent.wait(h, { timeoutMs, signal }))),
      );
    } catch (e) {
      span.fail(e);
      throw e;
    } finally {
      span.end();
    }
  }

  /** lease: the read must have ended before the lease (moved by heartbeats sent while it ran) minus the margin. */
  #leaseAfter(engine: RemoteEngine, done: number): void {
    if (!this.#o.lease) return;
    const { deadlineMs, marginMs } = this.#d.leases.window(engine, this.#o.lease, this.#o.requestId);
    if (done + marginMs > deadlineMs)
      throw this.#fail(
        'expired',
        new NixlError(
          `the read of request '${this.#o.requestId}' ended ${(done + marginMs - deadlineMs).toFixed(1)} ms too close to (or after) the prefill's lease end (margin ${marginMs.toFixed(1)} ms): its blocks may have been reused`,
          'NIXL_ERR_LEASE_EXPIRED',
        ),
      );
  }

  /**
   * confirm: the prefill's own word. Its board still says held, so nothing
   * freed the blocks before our read ended; only then may it free them.
   */
  async #confirm(engine: RemoteEngine, notif: string): Promise<void> {
    const confirm = engine.reads.filter((p) => !p.read.notifyOnly && this.#boardOf(p));
    if (confirm.length === 0) return;
    const { requestId, timeoutMs } = this.#o;
    const c = this.#child('kv.confirm', { 'nixl_node.ranks': confirm.length });
    const verdicts = await this.#as(this.#waitKind, () =>
      Promise.all(
        confirm.map((p) => this.#d.boards.verdict(p.rank.agentName, p.rank.board!, requestId, timeoutMs ?? 5000)),
      ),
    ).finally(() => c.end());
    const i = verdicts.findIndex((v) => v !== 'held');
    if (i >= 0)
      throw this.#fail(
        'expired',
        new NixlError(
          `prefill rank ${confirm[i].rank.rank} no longer held request '${requestId}' when the read ended (${verdictText(verdicts[i])}): its blocks may have been reused`,
          'NIXL_ERR_LEASE_EXPIRED',
        ),
      );
    const n = this.#child('kv.notify', { 'nixl_node.ranks': confirm.length });
    for (const p of confirm) this.#d.notify(p.rank.agentName, notif);
    n.end();
  }

  #record(engine: RemoteEngine, posted: Posted, transferMs: number): PullResult {
    const { bytes, descriptors, postMs, coalesced } = posted;
    const live = this.#d.live;
    if (transferMs > 0) live.rate = live.rate === 0 ? bytes / transferMs : 0.8 * live.rate + 0.2 * (bytes / transferMs);
    this.#d.stats.recordTransfer(bytes, descriptors, postMs, transferMs);
    return {
      requestId: this.#o.requestId,
      bytes,
      descriptors,
      postMs,
      transferMs,
      remoteRanks: engine.plan.reads.map((x) => x.remoteRank),
      coalesced,
    };
  }

  /** Counts the failure; a gone peer or a failed transfer handshakes afresh next time. */
  #failed(e: unknown): PullError {
    this.#d.stats.recordFailedTransfer();
    const err = e instanceof PullError ? e : this.#fail('setup', e);
    if (err.kind === 'expired') this.#d.stats.recordExpired();
    if (this.#engine && (err.kind === 'peer-gone' || err.kind === 'transfer'))
      this.#d.engines.forget(this.#engine, this.#attempt?.promise);
    return err;
  }

  #cleanUp(): void {
    for (const h of this.#handles) {
      try {
        this.#d.agent.releaseXferHandle(h);
      } catch {
        /* agent closed */
      }
      this.#d.live.xfers--;
    }
    const engine = this.#engine;
    if (engine) {
      engine.pulls--;
      if (engine.pulls === 0) engine.retired?.();
    }
    this.#d.slots.release(this.#key);
  }
}
