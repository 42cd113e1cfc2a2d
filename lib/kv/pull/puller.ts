// The decode side: handshake with the prefill ranks this rank reads from
// (every pipeline rank x the TP ranks it maps to, nothing else), prepare
// descriptor lists once per remote engine and rank, keep the prefill's lease
// alive with heartbeats while a request waits (v12), and pull a request's
// blocks with one call, from block ids or straight from kv_transfer_params.
//
// KvPuller wires the roles together: remote engines (remote-engines.ts),
// lease keeping (leases.ts), pull slots (pull-slots.ts) and the pull itself
// as a pipeline of stages (pull-stages.ts).
import type { NixlAgent } from '../../agent';
import type { NixlError } from '../../errors';
import type { KvTransferParams, WireProfile } from '../../handshake/model';
import { wireProfile } from '../../handshake/wire';
import { type SpanLike, startSpan } from '../../tracing';
import { engineKey } from '../engine-connect';
import { checkLayout, type KvLayout } from '../layout';
import { BoardReader } from '../lease-board';
import { LeaseKeeper } from '../leases';
import { DEFAULT_LIMITS, type PullLimits } from '../limits';
import { type KvPeers, type PeerEngines, peersFor } from '../peers';
import { checkedParams, endpointOf, expand, paramsRequestId } from './params';
import { EngineSlots } from './slots';
import { type PullDeps, PullRun } from './stages';
import {
  type KvPullerOptions,
  PullError,
  type PullFromParamsOptions,
  type PullOptions,
  type PullResult,
} from './types';
import type { RemoteEndpoint, RemoteEngine } from '../remote-engines';
import { KvStats } from '../stats';

export type { RemoteEndpoint } from '../engine-connect';
export type { RemoteLease } from '../leases';
export { expand } from './params';
export {
  type KvPullerOptions,
  type PullFailure,
  PullError,
  type PullFromParamsOptions,
  type PullOptions,
  type PullResult,
} from './types';

/**
 * The decode side of disaggregated serving: handshakes with prefill engines,
 * maps TP ranks, pulls blocks, sends the completion notification, and fails a
 * pull it cannot prove right (lease expired, peer gone, bad metadata).
 */
export class KvPuller {
  readonly stats = new KvStats();
  readonly #agent: NixlAgent;
  readonly #layout: KvLayout;
  readonly #opts: KvPullerOptions;
  readonly #wire: WireProfile;
  readonly #limits: Required<PullLimits>;
  readonly #peers: KvPeers;
  /** The peers were made here (else given: their maker closes them). */
  readonly #ownPeers: boolean;
  readonly #engines: PeerEngines;
  readonly #leases: LeaseKeeper<RemoteEndpoint, RemoteEngine>;
  readonly #boards: BoardReader;
  readonly #deps: PullDeps;
  #closed = false;
  /** The span of each pull in flight, by remote request id (heartbeats are events on it). */
  readonly #pullSpans = new Map<string, SpanLike>();

  constructor(opts: KvPullerOptions) {
    checkLayout(opts.layout);
    this.#agent = opts.agent;
    this.#layout = opts.layout;
    this.#opts = opts;
    const { peers, own } = peersFor(opts, 'KvPuller');
    this.#peers = peers;
    this.#ownPeers = own;
    this.#wire = wireProfile(opts.wire ?? peers.wire);
    this.#limits = { ...DEFAULT_LIMITS, ...opts.limits };
    this.#boards = new BoardReader(opts.agent);
    this.#engines = peers.engines({ expectedHash: opts.expectedHash });
    this.#leases = new LeaseKeeper({
      wire: this.#wire,
      kvLeaseMs: opts.kvLeaseMs,
      leaseSlackMs: opts.leaseSlackMs,
      keyOf: engineKey,
      engineFor: (ep) => this.#engines.get(ep),
      notify: (name, msg) => this.#notify(name, msg),
      onHeartbeat: (ids, delivered) => {
        for (const id of ids) this.#pullSpans.get(id)?.addEvent('heartbeat', { 'nixl_node.delivered': delivered });
      },
    });
    this.#deps = {
      agent: opts.agent,
      layout: opts.layout,
      wire: this.#wire,
      limits: this.#limits,
      coalesce: opts.coalesce ?? false,
      engines: this.#engines,
      local: peers.local,
      leaseBoards: opts.leaseBoards !== false,
      slots: new EngineSlots(opts.maxConcurrent ?? 16),
      leases: this.#leases,
      boards: this.#boards,
      stats: this.stats,
      notify: (name, msg) => this.#notify(name, msg),
      isClosed: () => this.#closed,
      live: { xfers: 0, rate: 0 },
    };
  }

  get wire(): WireProfile {
    return this.#wire;
  }

  /** Heartbeats sent so far (v12). */
  get heartbeatsSent(): number {
    return this.#leases.heartbeatsSent;
  }

  /** Handshakes and prepares descriptor lists ahead of the first pull (pulls do it once per remote engine). */
  async connect(ep: RemoteEndpoint): Promise<void> {
    await this.#engines.get(ep);
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
      const r = await new PullRun(this.#deps, opts, span).run();
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
      p = checkedParams(params, localLogical.length, {
        layout: this.#layout,
        wire: this.#wire,
        limits: this.#limits,
        paramsSecret: this.#opts.paramsSecret,
      });
    } catch (e) {
      const err = e as NixlError;
      const id = paramsRequestId(params);
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
    const release = opts.continuation ? () => {} : this.holdRemote(ep, p.remoteRequestId);
    try {
      return await this.pullBlocks({
        remote: ep,
        requestId: p.remoteRequestId,
        localBlockIds: expand(localLogical, this.#layout.physicalBlocksPerLogical ?? 1),
        remoteBlockIds: p.remoteBlockIds[0],
        remoteIdsAreLogical: true,
        remoteRange: opts.continuation ? 'head' : 'tail',
        timeoutMs: opts.timeoutMs,
        signal: opts.signal,
        coalesce: opts.coalesce,
        traceContext: opts.traceContext,
        handshake: opts.handshake,
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
    return this.#leases.hold(ep, remoteRequestId);
  }

  /** v12: the prefill's clock minus ours, seconds (lowest-RTT handshake sample). */
  async clockOffset(ep: RemoteEndpoint): Promise<number | undefined> {
    return (await this.#engines.get(ep)).clockOffsetS;
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
    return (await this.#engines.get(ep)).handshakeMs;
  }

  /** What the puller holds right now (tests check nothing leaks). */
  resources(): {
    xferHandles: number;
    localDlists: number;
    engines: number;
    activePulls: number;
    remoteAgents: number;
  } {
    return {
      xferHandles: this.#deps.live.xfers,
      localDlists: this.#peers.local.size,
      engines: this.#engines.size,
      activePulls: this.#deps.slots.active(),
      remoteAgents: this.#engines.remoteAgents,
    };
  }

  /** Stops: in-flight pulls fail, remote agents are forgotten. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#leases.close();
    if (this.#ownPeers) await this.#peers.close();
    this.#boards.close();
  }
}
