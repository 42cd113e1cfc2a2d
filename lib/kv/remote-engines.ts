// The remote engines one agent transfers with (peers.ts): one connection per
// engine key (engine-connect.ts) and use, its remote agents loaded once
// however many connections reach them, and a restarted engine (same engine
// id, new agents) replacing its older self once that one's transfers end.
import { checkPeerUcxMode } from '../ucx';
import { DlistHandle, type NixlAgent } from '../agent';
import { DescList } from '../descriptors';
import { NixlError } from '../errors';
import type { NixlAgentMetadata, WireProfile } from '../handshake/model';
import type { FetchResult, HandshakeStrategy, TlsClientOptions } from '../handshake/types';
import { type BlockSlices, allBlockDescs, regionCounts } from './descs';
import {
  ConnectSteps,
  type RemoteEndpoint,
  type RemoteEngine,
  type RemoteRank,
  checkAgreement,
  engineKey,
  fetchRanks,
  newEngine,
  planPipeline,
  usableBoard,
} from './engine-connect';
import type { KvLayout } from './layout';
import { type PullLimits, checkRemoteSizes } from './limits';
import type { LocalDlists } from './local-dlists';
import type { HandshakeBudget } from './connect-wait';
import { type ReadPlan, handshakeTargets } from './tp';

/** @internal */
export interface RemoteEnginesOptions {
  agent: NixlAgent;
  layout: KvLayout;
  handshake: HandshakeStrategy;
  wire: WireProfile;
  limits: Required<PullLimits>;
  local: LocalDlists;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
}

/** How one role connects: what it asks of the remote engine. @internal */
export interface ConnectUse {
  /** The compatibility hash the remote must answer; undefined skips the check. */
  expectedHash?: string;
  /**
   * Load the remote agents only, to exchange notifications (a push decode
   * registering with its prefill): no geometry checks, no descriptor lists,
   * no reads planned (hash and engine id are still checked). A full
   * connection already made with the same hash serves such a use too.
   */
  notifOnly?: boolean;
}

/** The cache key of a connection: the endpoint, the hash checked, and whether it is notif-only. */
function connKey(ep: RemoteEndpoint, use: ConnectUse): string {
  return JSON.stringify([use.notifOnly ? 'notif' : 'full', use.expectedHash ?? null, engineKey(ep)]);
}

/** The dlist of a notif-only rank: none. */
const NO_DLIST = new DlistHandle(-1, '', 0);

/** What a connect loaded so far: undone when a later rank fails. */
interface Loaded {
  agents: string[];
  dlists: DlistHandle[];
}

/** A connect in progress or done: its engine, and which kind of step failed if one did. @internal */
export interface ConnectAttempt {
  readonly promise: Promise<RemoteEngine>;
  readonly steps: ConnectSteps;
}

/** @internal */
export class RemoteEngines {
  readonly #o: RemoteEnginesOptions;
  readonly #attempts = new Map<string, ConnectAttempt>();
  /** Attempts that connected (a notif-only use borrows a full connection only once it stands). */
  readonly #ready = new WeakSet<ConnectAttempt>();
  /** Each engine's cache key (its `key` is the endpoint's, which leases go by). */
  readonly #keyOf = new WeakMap<RemoteEngine, string>();
  /** Connected engines not dropped yet, and how many of them use each loaded remote agent. */
  readonly #live = new Set<RemoteEngine>();
  readonly #agentUsers = new Map<string, number>();
  #closed = false;

  constructor(o: RemoteEnginesOptions) {
    this.#o = o;
  }

  /** The connect for an endpoint and use: the cached one, else a new one (with `budget`, else the default one). */
  attempt(ep: RemoteEndpoint, use: ConnectUse, budget?: HandshakeBudget): ConnectAttempt {
    const full = this.#fullFor(ep, use);
    if (full) return full;
    const key = connKey(ep, use);
    const had = this.#attempts.get(key);
    if (had) return had;
    const steps = new ConnectSteps();
    const mine: ConnectAttempt = { promise: this.#connect(key, ep, use, steps, budget), steps };
    this.#attempts.set(key, mine);
    mine.promise.then(
      () => this.#ready.add(mine),
      // Only this connect's own entry: a newer one for the same key stays.
      () => {
        if (this.#attempts.get(key) === mine) this.#attempts.delete(key);
      },
    );
    return mine;
  }

  /** For a notif-only use, a full connection with the same hash that stands already. */
  #fullFor(ep: RemoteEndpoint, use: ConnectUse): ConnectAttempt | undefined {
    if (!use.notifOnly) return undefined;
    const a = this.#attempts.get(connKey(ep, { ...use, notifOnly: false }));
    return a && this.#ready.has(a) ? a : undefined;
  }

  /** Whether a connect for the endpoint and use is cached (done or under way). */
  has(ep: RemoteEndpoint, use: ConnectUse): boolean {
    return this.#fullFor(ep, use) !== undefined || this.#attempts.has(connKey(ep, use));
  }

  /** Engine keys cached. */
  get size(): number {
    return this.#attempts.size;
  }

  /** Remote agents loaded. */
  get remoteAgents(): number {
    return this.#agentUsers.size;
  }

  async #connect(
    key: string,
    ep: RemoteEndpoint,
    use: ConnectUse,
    steps: ConnectSteps,
    budget: HandshakeBudget | undefined,
  ): Promise<RemoteEngine> {
    const t0 = performance.now();
    const { layout, limits } = this.#o;
    const targets = steps.run('setup', () => {
      checkRemoteSizes(layout, ep, limits);
      return handshakeTargets(layout.tpSize, layout.tpRank, ep);
    });
    const geometry = !use.notifOnly;
    const fetch = (t: { ppRank: number; tpRank: number }) => this.#fetch(ep, use, t, budget);
    const fetched = await fetchRanks(steps, ep, layout, limits, targets, fetch, geometry);
    const metas = fetched.map((f) => f.metadata);
    const plans = steps.run('handshake', () => {
      checkAgreement(ep, targets, metas);
      checkPeerUcxMode(this.#o.agent, metas);
      return geometry ? planPipeline(layout, ep, metas) : [{ tpRatio: 0, replicated: false, reads: [] }];
    });
    // A restarted prefill (same engine id, new agents) replaces what we hold
    // of its old self: that must be unloaded before the new agents load.
    await this.#replaceOlder(metas[0].engineId, metas);
    const engine = newEngine(engineKey(ep), plans[0], fetched);
    this.#keyOf.set(engine, key);
    steps.run('setup', () => this.#load(engine, targets, metas, plans, geometry));
    engine.handshakeMs = performance.now() - t0;
    this.#live.add(engine);
    return engine;
  }

  #fetch(
    ep: RemoteEndpoint,
    use: ConnectUse,
    t: { ppRank: number; tpRank: number },
    budget: HandshakeBudget | undefined,
  ): Promise<FetchResult> {
    return this.#o.handshake.fetch({
      host: ep.host,
      port: ep.port,
      dpRank: ep.dpRank,
      tpRank: t.tpRank,
      ppRank: t.ppRank,
      wire: this.#o.wire,
      expectedHash: use.expectedHash,
      timeoutMs: budget?.timeoutMs ?? this.#o.handshakeTimeoutMs,
      retries: budget?.retries,
      tls: this.#o.tls,
      bearerToken: this.#o.bearerToken,
    });
  }

  /**
   * Loads every rank's agent and prepares its remote list; on any failure
   * undoes all it loaded, so that the next handshake (a corrected or
   * restarted prefill with the same agent names) loads.
   */
  #load(
    engine: RemoteEngine,
    targets: ReadonlyArray<{ ppRank: number; tpRank: number }>,
    metas: NixlAgentMetadata[],
    plans: ReadPlan[],
    geometry: boolean,
  ): void {
    const perPp = targets.length / plans.length;
    const undo: Loaded = { agents: [], dlists: [] };
    try {
      if (this.#closed) throw new NixlError('puller is closed', 'NIXL_ERR_NOT_ALLOWED');
      targets.forEach((t, i) => {
        if (!geometry) {
          engine.ranks.set(`${t.ppRank}:${t.tpRank}`, this.#loadAgentOnly(t, metas[i], undo));
          return;
        }
        const read = plans[t.ppRank].reads[i % perPp];
        const local = this.#o.local.slices(read);
        const remote: BlockSlices = {
          baseAddrs: metas[i].kvCachesBaseAddr,
          strides: metas[i].blockStrides,
          offsets: read.remoteOffset,
          lens: local.lens,
          devId: metas[i].deviceId,
        };
        const rank = this.#loadRank(t, metas[i], remote, undo);
        engine.ranks.set(`${t.ppRank}:${t.tpRank}`, rank);
        if (!read.notifyOnly) this.#o.local.get(read);
        engine.reads.push({ read, rank, local, remote, blockBytes: local.lens.reduce((a, b) => a + b, 0) });
      });
    } catch (e) {
      for (const d of undo.dlists) this.#quietly(() => this.#o.agent.releaseDlistHandle(d));
      for (const n of undo.agents) this.#unuseAgent(n);
      throw e;
    }
  }

  /** One rank's agent (shared when already loaded) and its prepared list, noted in `undo` as they load. */
  #loadRank(
    t: { ppRank: number; tpRank: number },
    meta: NixlAgentMetadata,
    remote: BlockSlices,
    undo: Loaded,
  ): RemoteRank {
    const counts = meta.regionNumBlocks ?? regionCounts(meta.kvCachesBaseAddr.length, meta.numBlocks);
    // The same prefill reached under another key (host name, engine id
    // given or not) shares the agent already loaded.
    const agentName = this.#loadedAs(meta.agentMetadata) ?? this.#o.agent.addRemoteAgent(meta.agentMetadata);
    this.#agentUsers.set(agentName, (this.#agentUsers.get(agentName) ?? 0) + 1);
    undo.agents.push(agentName);
    const dlist = this.#o.agent.prepXferDlist(
      agentName,
      new DescList(allBlockDescs(remote, counts), this.#o.layout.memType ?? 'DRAM'),
    );
    undo.dlists.push(dlist);
    return {
      ppRank: t.ppRank,
      rank: t.tpRank,
      agentName,
      meta,
      dlist,
      counts,
      // Recorded whoever connects; a role that confirms nothing against it (KvPullerOptions.leaseBoards) ignores it.
      board: usableBoard(meta.nixlNodeLeaseBoard),
    };
  }

  /** One rank's agent only (notif-only); its dlist is an empty placeholder never released. */
  #loadAgentOnly(t: { ppRank: number; tpRank: number }, meta: NixlAgentMetadata, undo: Loaded): RemoteRank {
    const agentName = this.#loadedAs(meta.agentMetadata) ?? this.#o.agent.addRemoteAgent(meta.agentMetadata);
    this.#agentUsers.set(agentName, (this.#agentUsers.get(agentName) ?? 0) + 1);
    undo.agents.push(agentName);
    return { ppRank: t.ppRank, rank: t.tpRank, agentName, meta, dlist: NO_DLIST, counts: [] };
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
    this.#quietly(() => this.#o.agent.removeRemoteAgent(name));
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
        const key = this.#keyOf.get(old)!;
        const a = this.#attempts.get(key);
        if (a) void a.promise.then((e) => e === old && this.#attempts.get(key) === a && this.#attempts.delete(key));
        if (old.pulls === 0) {
          this.forget(old, undefined);
          return undefined;
        }
        if (!named(old)) {
          old.retired = () => this.forget(old, undefined);
          return undefined;
        }
        return new Promise<void>((resolve) => {
          old.retired = () => {
            this.forget(old, undefined);
            resolve();
          };
        });
      }),
    );
  }

  #quietly(f: () => void): void {
    try {
      f();
    } catch {
      /* already gone, or the agent is closed */
    }
  }

  /**
   * Forgets one connected engine: its cache entry only if `promise` is still
   * the current one (a newer connect for the key stays), and its remote
   * agents and dlists once, however many of its pulls fail. Synchronous, so
   * a new connect can never see the old agents still loaded.
   */
  forget(engine: RemoteEngine, promise: Promise<RemoteEngine> | undefined): void {
    const key = this.#keyOf.get(engine);
    if (promise && key !== undefined && this.#attempts.get(key)?.promise === promise) this.#attempts.delete(key);
    if (engine.dropped) return;
    engine.dropped = true;
    this.#live.delete(engine);
    for (const r of engine.ranks.values()) {
      if (r.dlist !== NO_DLIST) this.#quietly(() => this.#o.agent.releaseDlistHandle(r.dlist));
      this.#unuseAgent(r.agentName);
    }
  }

  /** Refuses new loads and forgets every engine. */
  async close(): Promise<void> {
    this.#closed = true;
    for (const a of [...this.#attempts.values()]) {
      const engine = await a.promise.catch(() => undefined);
      if (engine) this.forget(engine, a.promise);
    }
  }
}

export { engineKey, type RemoteEndpoint, type RemoteEngine } from './engine-connect';
