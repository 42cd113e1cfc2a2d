// The peers of one agent: its handshake client, the remote engines it is
// connected to and its prepared local lists, in one place. A worker that
// pulls and pushes gives the same KvPeers to its KvPuller, KvPushReceiver and
// KvPushSender, so each remote engine is connected (and its agents loaded)
// once, not once per role: loading an agent twice, or one role unloading what
// another still uses, is what three separate caches over one agent risk.
import type { NixlAgent } from '../agent';
import { NixlError } from '../errors';
import { createHandshake } from '../handshake';
import type { WireName, WireProfile } from '../handshake/model';
import type { HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../handshake/types';
import { wireProfile } from '../handshake/wire';
import type { HandshakeBudget } from './connect-wait';
import type { RemoteEndpoint, RemoteEngine } from './engine-connect';
import { checkLayout, type KvLayout } from './layout';
import { DEFAULT_LIMITS, type PullLimits } from './limits';
import { LocalDlists } from './local-dlists';
import { type ConnectAttempt, type ConnectUse, RemoteEngines } from './remote-engines';

/** Options of a KvPeers: the agent, its KV cache, and how it connects to remote engines. */
export interface KvPeersOptions {
  agent: NixlAgent;
  layout: KvLayout;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** Default: NIXL_WIRE, else v12. */
  wire?: WireName | WireProfile;
  /** Bounds on what a remote engine may size (limits.ts). */
  limits?: PullLimits;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
}

/**
 * One agent's connections to remote engines, shared by the KV roles over it
 * (option `peers` of KvPuller, KvPushReceiver and KvPushSender). Whoever
 * makes it closes it, after the roles given it.
 */
export class KvPeers {
  readonly agent: NixlAgent;
  readonly layout: KvLayout;
  readonly wire: WireProfile;
  /** @internal */
  readonly limits: Required<PullLimits>;
  /** @internal */
  readonly handshake: HandshakeStrategy;
  /** @internal */
  readonly local: LocalDlists;
  readonly #engines: RemoteEngines;
  #closed = false;

  constructor(o: KvPeersOptions) {
    checkLayout(o.layout);
    this.agent = o.agent;
    this.layout = o.layout;
    this.wire = wireProfile(o.wire);
    this.limits = { ...DEFAULT_LIMITS, ...o.limits };
    this.handshake = typeof o.handshake === 'object' ? o.handshake : createHandshake(o.handshake);
    this.local = new LocalDlists(o.agent, o.layout);
    this.#engines = new RemoteEngines({
      agent: o.agent,
      layout: o.layout,
      handshake: this.handshake,
      wire: this.wire,
      limits: this.limits,
      local: this.local,
      handshakeTimeoutMs: o.handshakeTimeoutMs,
      tls: o.tls,
      bearerToken: o.bearerToken,
    });
  }

  /** The engines as one role connects to them: the hash it expects, whether it exchanges notifications only. @internal */
  engines(use: ConnectUse): PeerEngines {
    return new PeerEngines(this.#engines, use);
  }

  /** What the peers hold right now (tests check nothing leaks, and that roles share). */
  resources(): { engines: number; remoteAgents: number; localDlists: number } {
    return { engines: this.#engines.size, remoteAgents: this.#engines.remoteAgents, localDlists: this.local.size };
  }

  /** Forgets every remote engine, releases the local lists, closes the handshake client. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#engines.close();
    this.local.close();
    this.handshake.close();
  }
}

/**
 * The peers a role uses (its own, or the KvPeers it was given), checked to
 * be over its agent, KV cache and wire profile. @internal
 */
export function peersFor(o: KvPeersOptions & { peers?: KvPeers }, role: string): { peers: KvPeers; own: boolean } {
  const p = o.peers;
  if (!p) return { peers: new KvPeers(o), own: true };
  const bad = (what: string) =>
    new NixlError(`${role}: the KvPeers given is over another ${what} than the ${role}'s`, 'NIXL_ERR_INVALID_PARAM');
  if (p.agent !== o.agent) throw bad('agent');
  if (p.layout.engineId !== o.layout.engineId || p.layout.tpRank !== o.layout.tpRank) throw bad('KV cache');
  if (o.wire !== undefined && wireProfile(o.wire).name !== p.wire.name) throw bad('wire profile');
  return { peers: p, own: false };
}

/** The remote engines as one role connects to them (see KvPeers.engines). @internal */
export class PeerEngines {
  readonly #e: RemoteEngines;
  readonly #use: ConnectUse;

  constructor(engines: RemoteEngines, use: ConnectUse) {
    this.#e = engines;
    this.#use = use;
  }

  /** The connect for an endpoint: the cached one, else a new one (with `budget`, else the default one). */
  attempt(ep: RemoteEndpoint, budget?: HandshakeBudget): ConnectAttempt {
    return this.#e.attempt(ep, this.#use, budget);
  }

  /** The connected engine of an endpoint (connecting first when needed). */
  get(ep: RemoteEndpoint): Promise<RemoteEngine> {
    return this.attempt(ep).promise;
  }

  /** Whether a connect this role would use is cached (done or under way). */
  has(ep: RemoteEndpoint): boolean {
    return this.#e.has(ep, this.#use);
  }

  forget(engine: RemoteEngine, promise: Promise<RemoteEngine> | undefined): void {
    this.#e.forget(engine, promise);
  }

  /** Connections cached (every role's). */
  get size(): number {
    return this.#e.size;
  }

  /** Remote agents loaded (every role's). */
  get remoteAgents(): number {
    return this.#e.remoteAgents;
  }
}
