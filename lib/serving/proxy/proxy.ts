// The disaggregated-serving proxy: an OpenAI-compatible HTTP front
// (front.ts) that sends each request through an encoder (when configured
// and the request has images), then its prefill and decode workers by the
// KV handoff picked here once (handoff-pull.ts or handoff-push.ts), and
// passes the decode's answer back, streamed (SSE) or not (dispatch.ts). This
// file wires them, starts and stops them, and runs the health rounds.
import type * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { NixlError } from '../../errors';
import type { WireName } from '../../handshake/model';
import { wireProfile } from '../../handshake/wire';
import { createLimitedServer } from '../api/http-server';
import { compileBodySchemas } from '../api/request-checks';
import { FleetDiscovery, type FleetWatchOptions } from '../fleet/discovery';
import type { RoutingOptions } from '../fleet/routing';
import { type KvEventsOptions, type PreciseRouting, preciseFor } from '../kv-index/precise';
import { type Logger, silentLogger } from '../log';
import { checkWorkerAddress } from './addresses';
import { type ConversationOptions, Conversations } from './conversations';
import { Dispatch } from './dispatch';
import { ProxyFront } from './front';
import type { KvHandoff } from './handoff';
import { PullHandoff } from './handoff-pull';
import { PushHandoff } from './handoff-push';
import { HealthRounds } from './health';
import { ProxyMetrics, type ProxyStats, proxyStats } from './metrics';
import { type Policy, type Stage, WorkerPool } from './pool';
import { StageCaller } from './stage-call';
import { HttpTransport } from './transports/http';
import type { WorkerTransport } from './transports/types';
import { ZmqTransport } from './transports/zmq';

/** Options of the serving proxy. */
export interface ProxyOptions {
  /**
   * Bidirectional KV (docs/multiturn.md): a request's `conversation_id` keys
   * the kv_transfer_params of its decode's held KV, which the conversation's
   * next turn gives its prefill. How many entries and how long (default 10000, 450 s).
   */
  conversations?: ConversationOptions;
  /** Interface to bind: 127.0.0.1 unless told otherwise. */
  host?: string;
  /** 0: any free port. */
  port?: number;
  transport?: 'http' | 'zmq';
  /** Worker addresses: HTTP base URLs, or ZMQ addresses (tcp://, ipc://); with `etcd`, these may be empty. */
  prefill?: string[];
  decode?: string[];
  encode?: string[];
  /** Also the workers registered in etcd, followed as they come and go (docs/fleet.md). */
  etcd?: FleetWatchOptions;
  policy?: Policy;
  /** The 'load' policy's weights and prefix affinity. */
  routing?: RoutingOptions;
  /** The workers' KV events (--kv-events-endpoint) and the 'precise' policy's settings (docs/kv-events.md). */
  kvEvents?: KvEventsOptions;
  /** Per stage, ms (default 60 s each). */
  timeoutMs?: Partial<Record<Stage, number>>;
  /** Health checks, ms between rounds (default 2000; 0: none). */
  healthIntervalMs?: number;
  /** Other prefill workers to try when one fails before answering (default 1). */
  prefillRetries?: number;
  /** Requires `Authorization: Bearer <token>` on the API routes. */
  bearerToken?: string;
  /** Largest request body, bytes (default 1 MiB). */
  maxBodyBytes?: number;
  /** The wire profile the prefills' kv_transfer_params are checked against (default NIXL_WIRE, else v12). */
  wire?: WireName;
  /** ZMQ: the PULL address for replies (default tcp://127.0.0.1:*). */
  zmqReplyAddr?: string;
  /** A request whose headers and body have not all arrived by then is cut (default 30 s). */
  requestTimeoutMs?: number;
  /** Open client connections at most (default 4096; lib/serving/api/http-server.ts). */
  maxConnections?: number;
  /**
   * Where the proxy logs (pino, or anything with its `(fields, message)`
   * methods): a line per request, and one when a worker goes unhealthy, is
   * ejected after a failed request, comes back, or the pools' models do not
   * pair. Default: nothing is logged.
   */
  logger?: Logger;
  /**
   * How KV moves (docs/kv-push.md): 'pull' (default: prefill, then decode
   * with its kv_transfer_params) or 'push' (both legs at once; the prefill
   * WRITEs into the blocks the decode registered). Workers must serve that mode.
   */
  kvMode?: 'pull' | 'push';
}

type KvMode = NonNullable<ProxyOptions['kvMode']>;
const HANDOFFS: Record<KvMode, (calls: StageCaller, o: ProxyOptions) => KvHandoff> = {
  pull: (calls, o) => new PullHandoff(calls, o),
  push: (calls) => new PushHandoff(calls),
};

/** How KV moves, picked once by ProxyOptions.kvMode (default pull): the one place the proxy decides it. */
function kvHandoff(calls: StageCaller, o: ProxyOptions): KvHandoff {
  const mode = o.kvMode ?? 'pull';
  if (!Object.hasOwn(HANDOFFS, mode))
    throw new NixlError(
      `kvMode must be one of ${Object.keys(HANDOFFS).join(', ')}, got '${mode}'`,
      'NIXL_ERR_INVALID_PARAM',
    );
  return HANDOFFS[mode](calls, o);
}

/**
 * The disaggregated-serving front door: an OpenAI-compatible server that
 * sends each request through encode, prefill and decode workers.
 */
export class ServingProxy {
  readonly pools: Record<Stage, WorkerPool>;
  readonly stats: ProxyStats = proxyStats();
  url = '';
  /** conversation_id -> the params of its last turn's KV, held by the decode that answered it. */
  readonly conversations: Conversations;
  /** The workers etcd lists, when given `etcd`. */
  fleet?: FleetDiscovery;
  /**
   * The prefills' KV events and the 'precise' policy, when asked for.
   * @internal
   */
  kvRouting?: PreciseRouting;
  readonly #o: ProxyOptions;
  readonly #transport: WorkerTransport;
  readonly #server: http.Server;
  readonly #health: HealthRounds;
  readonly #front: ProxyFront;
  /** start() runs once: a second, or one after close(), would listen with nothing to close it. */
  #started = false;
  #starting?: Promise<this>;
  #closing?: Promise<void>;

  constructor(o: ProxyOptions) {
    this.#o = o;
    this.conversations = new Conversations(o.conversations);
    if (!o.etcd && (!o.prefill?.length || !o.decode?.length))
      throw new NixlError('a proxy needs prefill and decode workers (or etcd to find them)', 'NIXL_ERR_INVALID_PARAM');
    wireProfile(o.wire);
    const log = o.logger ?? silentLogger;
    const prom = ProxyMetrics.create();
    const policy = o.policy ?? 'round-robin';
    const kind = o.transport ?? 'http';
    const checked = (role: Stage, list: string[] = []) => list.map((a) => checkWorkerAddress(a, kind, role));
    this.pools = {
      encode: new WorkerPool('encode', checked('encode', o.encode), policy, o.routing),
      prefill: new WorkerPool('prefill', checked('prefill', o.prefill), policy, o.routing),
      decode: new WorkerPool('decode', checked('decode', o.decode), policy, o.routing),
    };
    this.#transport = kind === 'zmq' ? new ZmqTransport() : new HttpTransport();
    this.#health = new HealthRounds(this.pools, this.#transport, log, prom);
    const calls = new StageCaller({
      pools: this.pools,
      transport: this.#transport,
      health: this.#health,
      stats: this.stats,
      prom,
      timeoutMs: o.timeoutMs,
    });
    const dispatch = new Dispatch(calls, kvHandoff(calls, o), this.conversations);
    this.kvRouting = preciseFor(policy, this.pools.prefill, o.kvEvents, prom?.registry, log);
    const { bearerToken, maxBodyBytes, routing } = o;
    const front = { bearerToken, maxBodyBytes, routing, pools: this.pools, dispatch, stats: this.stats, log, prom };
    this.#front = new ProxyFront({ ...front, kvRouting: this.kvRouting });
    this.#server = createLimitedServer(
      { requestTimeoutMs: o.requestTimeoutMs ?? 30_000, maxConnections: o.maxConnections },
      (req, res) => void this.#front.onRequest(req, res),
    );
    if (o.etcd) this.fleet = new FleetDiscovery(this.pools, kind, o.etcd, prom?.registry, log);
  }

  /** Listens; resolves once the proxy takes requests. */
  start(): Promise<this> {
    if (this.#started || this.#closing)
      return Promise.reject(
        new NixlError(`this proxy was ${this.#closing ? 'closed' : 'started'} already`, 'NIXL_ERR_NOT_ALLOWED'),
      );
    this.#started = true;
    this.#starting = this.#start();
    return this.#starting;
  }

  /**
   * A close() meanwhile stops the start at its next step (NIXL_ERR_CANCELED)
   * and waits for it: a step taken after the close (a listen, a timer, a
   * subscription) would have nothing left to undo it.
   */
  async #start(): Promise<this> {
    const go = () => {
      if (this.#closing) throw new NixlError('the proxy was closed while it started', 'NIXL_ERR_CANCELED');
    };
    await this.kvRouting?.ready(); // a GGUF vocabulary that cannot load fails the start, before anything listens
    go();
    if (this.#transport instanceof ZmqTransport) await this.#transport.bind(this.#o.zmqReplyAddr);
    go();
    const host = this.#o.host ?? '127.0.0.1';
    await new Promise<void>((resolve, reject) => {
      this.#server.once('error', reject);
      this.#server.listen(this.#o.port ?? 0, host, () => resolve());
    });
    this.url = `http://${host.includes(':') ? `[${host}]` : host}:${(this.#server.address() as AddressInfo).port}`;
    go();
    await this.fleet?.start();
    go();
    this.kvRouting?.start();
    const every = this.#o.healthIntervalMs ?? 2000;
    if (every > 0) {
      // One round first: once start() resolves, /v1/models and /health say what the workers serve.
      await this.checkHealth({ learnOnly: true });
      go();
      this.#health.every(every);
    }
    return this;
  }

  /**
   * One round of health checks over every worker. `learnOnly`: only learn
   * what the workers serve; one slow to answer its first check (a process
   * just started, a ZeroMQ peer still connecting) is not taken out for it.
   */
  checkHealth(o: { learnOnly?: boolean } = {}): Promise<void> {
    return this.#health.check(o);
  }

  /** Stops: requests in flight are aborted, sockets closed. */
  close(): Promise<void> {
    this.#closing ??= this.#close();
    return this.#closing;
  }

  async #close(): Promise<void> {
    await this.#starting?.catch(() => {});
    this.#health.stop();
    await this.fleet?.close();
    await this.kvRouting?.close();
    this.#front.abortAll(new Error('proxy closing'));
    this.#server.closeAllConnections();
    await new Promise((r) => this.#server.close(r));
    await this.#transport.close();
  }
}

/** Starts a serving proxy. */
export async function startProxy(o: ProxyOptions): Promise<ServingProxy> {
  compileBodySchemas(); // at startup, not on the first request (a missing or broken docs/ schema fails here)
  const proxy = new ServingProxy(o);
  try {
    return await proxy.start();
  } catch (e) {
    await proxy.close().catch(() => {}); // what started before the failure (a vocabulary, a socket)
    throw e;
  }
}
