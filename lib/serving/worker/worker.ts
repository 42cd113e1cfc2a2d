// A Node inference worker for the serving proxy: the wiring between a front
// (fronts/http.ts: OpenAI-compatible HTTP; fronts/zmq.ts: the proxy's ZeroMQ
// protocol), its roles (roles.ts: encode, prefill, decode, aggregated) and a
// model (models/: the synthetic one, or a GGUF through node-llama-cpp). It
// owns the parts the roles are given: the registered blocks (block-store.ts),
// the holds (holds.ts), the KV mode picked once (handoff.ts) and the turns
// (turns.ts); it starts and stops them, and says how it is (health, fleet).
import { randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import { type EngineKind, NixlAgent } from '../../agent';
import { NixlError } from '../../errors';
import type { WireName } from '../../handshake/model';
import { wireProfile } from '../../handshake/wire';
import { servePrefill } from '../../kv/prefill';
import { DEFAULT_TURN_TTL_MS } from '../../kv/turn-params';
import { contextFromTraceparent, startSpan } from '../../tracing';
import { failure } from '../api/errors';
import { HttpError } from '../api/http';
import { compileBodySchemas } from '../api/request-checks';
import { type FleetJoinOptions, FleetRegistration } from '../fleet/registry';
import { type Logger, silentLogger } from '../log';
import { LlamaModel } from '../models/llama';
import { SyntheticModel } from '../models/synthetic';
import { DEFAULT_MODEL, type SyntheticModelSpec } from '../models/synthetic-kv';
import type { ServingModel } from '../models/types';
import { BlockStore } from './block-store';
import { type BlockQueueOptions, checkBlockQueueOptions } from './blocks';
import { httpErrorOf } from './failures';
import type { FrontHandler, WorkerRequest } from './fronts/front';
import { serveHttp } from './fronts/http';
import { MetricsPort } from './fronts/metrics-port';
import { ZmqFront } from './fronts/zmq';
import type { KvHandoff, KvMode } from './handoff';
import { PullHandoff } from './handoff-pull';
import { checkKvMode, handoffFor } from './handoff-push';
import { HoldTable } from './holds';
import { KvEvents, type KvEventsConfig, parseKvEventsConfig } from './kv-events';
import { serve } from './roles';
import { type WorkerStats, newStats } from './stats';
import type { TestHooks } from './test-hooks';
import { DEFAULT_REUSE_HANDSHAKE_MS, TurnKv } from './turns';
import { WorkerMetrics } from './vllm-metrics';

/**
 * Options of a worker. kvWaitMs, kvQueueMax: how long and how many requests
 * wait for KV blocks when the cache is full (blocks.ts).
 */
export interface WorkerOptions extends BlockQueueOptions {
  name?: string;
  /** The names it answers to (vLLM --served-model-name); the first is the one it reports. Default: the model's. */
  servedModelNames?: string[];
  /** Interface of the side channel (vLLM VLLM_NIXL_SIDE_CHANNEL_HOST; default: host). */
  sideChannelHost?: string;
  transport?: 'http' | 'zmq';
  /** HTTP: interface and port of the API (default 127.0.0.1, any free port). */
  host?: string;
  /** HTTP port (default 0: any free port). */
  port?: number;
  /** ZMQ: the PULL address to bind (tcp://host:port, tcp://127.0.0.1:0 for any port, or ipc://path). */
  zmqAddr?: string;
  /** An HTTP port of its own for GET /metrics and /health, on host (0: any free port; default: none). */
  metricsPort?: number;
  /** Side channel of this worker's prefill KV (default: host, any free port). */
  sideChannelPort?: number;
  /** KV cache blocks (default 512). */
  blocks?: number;
  /**
   * The model: a GGUF file (needs the node-llama-cpp package), or the
   * synthetic model's shape (default).
   */
  model?: string | SyntheticModelSpec;
  /** GGUF: CPU threads of each context (default: the cores shared among `parallel`). */
  threads?: number;
  /** GGUF: tokens of each context (default 4096). */
  contextSize?: number;
  /** GGUF: requests evaluated at once, a context each (default 2). */
  parallel?: number;
  /** GGUF: tokens llama.cpp evaluates in one batch (default: the context size, at most 512). */
  batchSize?: number;
  /** GGUF: reuse a context's cached prompt prefix in whole batches (default true; the numbers do not change). */
  prefixCache?: boolean;
  /** GGUF: bytes of one KV block (default 64 KiB); a request's state takes as many as it needs. */
  blockBytes?: number;
  /**
   * GGUF: where states go through files on their way in and out of llama.cpp
   * (default: NIXL_NODE_STATE_DIR, else /dev/shm where writable, else the OS temp dir).
   */
  stateDir?: string;
  wire?: WireName;
  /** How long a prefill holds KV nobody read (default: the profile's lease, 30 s for v12). */
  leaseMs?: number;
  engine?: EngineKind;
  /** Largest request body, bytes (default 1 MiB). */
  maxBodyBytes?: number;
  /** HTTP: a request whose headers and body have not all arrived by then is cut (default 30 s). */
  requestTimeoutMs?: number;
  /**
   * A secret shared by the deployment's workers: prefills sign the
   * kv_transfer_params they return, decodes refuse unsigned or forged ones
   * (nothing read). Default: NIXL_NODE_KV_SECRET, else none (vLLM-compatible).
   */
  kvSecret?: string;
  /**
   * Where the worker logs (pino, or anything with its `(fields, message)`
   * methods): each request at debug, failed ones at warn (5xx) or info (4xx).
   * Default: nothing is logged.
   */
  logger?: Logger;
  /** Registers in etcd under a lease, so proxies given the same etcd find it (docs/fleet.md). */
  etcd?: FleetJoinOptions;
  /**
   * Bidirectional KV (vLLM bidirectional_kv_xfer; docs/multiturn.md): a
   * decode holds each answered turn's KV for the next turn's prefill and
   * returns kv_transfer_params naming it; a prefill given such params reads
   * what is provably its prompt's prefix instead of recomputing it.
   */
  bidirectionalKv?: boolean;
  /** How long a decode holds a finished turn, ms (vLLM decoder_kv_blocks_ttl: 480 s). */
  decoderKvTtlMs?: number;
  /** A prefill recomputes a previous turn's KV of fewer tokens than this (vLLM kv_recompute_threshold: 64). */
  kvRecomputeThreshold?: number;
  /** The share of the KV cache held turns may take together (default 0.5); past it a turn is not held. */
  heldTurnsShare?: number;
  /**
   * A prefill's handshake with the decode holding the previous turn: one
   * attempt of this many ms (default 1000), then it recomputes (reuse is an
   * optimisation; a dead decode must not delay the turn by the full 3 x 5 s
   * of a pull's handshake).
   */
  kvReuseHandshakeMs?: number;
  /**
   * How KV moves (docs/kv-push.md): 'pull' (default, vLLM NixlConnector) or
   * 'push' (NixlPushConnector: decodes register their blocks, prefills WRITE).
   */
  kvMode?: KvMode;
  /** Push: a decode's deadline for every WRITE, ms (default 30 s). */
  pushTimeoutMs?: number;
  /**
   * What tests do to a worker on purpose (test-hooks.ts); never set in a deployment.
   * @internal
   */
  testHooks?: TestHooks;
  /** Publishes its prefix cache as vLLM's KV events (vLLM --kv-events-config; docs/kv-events.md). */
  kvEvents?: KvEventsConfig | string;
}

export type { WorkerStats } from './stats';
export type { RequestHints, Sink, WorkerRequest } from './fronts/front';
export type { TestHooks } from './test-hooks';

/**
 * A Node inference worker: encoder, prefill, decode or aggregated, with the
 * synthetic model or a GGUF; KV moves by its KV mode (pull or push).
 */
export class Worker implements FrontHandler {
  readonly name: string;
  readonly stats: WorkerStats = newStats();
  /** HTTP: the base URL; ZMQ: the address to PUSH to. */
  address = '';
  readonly model: ServingModel;
  /** The registered KV cache blocks the roles and turns take from. @internal */
  readonly blocks: BlockStore;
  /** Every hold of this worker (prefills' blocks, push offers, held turns). @internal */
  readonly holds: HoldTable;
  /** Its KV mode, picked here once. @internal */
  readonly handoff: KvHandoff;
  /** @internal */
  readonly hooks: TestHooks;
  /** @internal */
  readonly secret: string | undefined;
  readonly #o: WorkerOptions;
  readonly #agent: NixlAgent;
  /** This worker's monotonic clock, ms (skewed by the test hook). */
  readonly #now: () => number;
  #side?: Awaited<ReturnType<typeof servePrefill>>;
  #http?: http.Server;
  #zmq?: ZmqFront;
  #metricsPort?: MetricsPort;
  #closed = false;
  /** Requests in progress (what it reports as its load). */
  #active = 0;
  /** Its record in etcd, when given `etcd`. */
  fleet?: FleetRegistration;
  /** Its KV events publisher, when kvEvents enables one. @internal */
  kvEvents?: KvEvents;
  /** Bidirectional KV: turns held here and read from elsewhere (bidirectionalKv). */
  readonly turns?: TurnKv;
  /** GET /metrics: vLLM's Prometheus series and nixl-node's; undefined without prom-client. @internal */
  readonly metrics?: WorkerMetrics;

  /** A worker around a loaded model (startWorker loads it from the options). */
  constructor(o: WorkerOptions, model: ServingModel = new SyntheticModel(DEFAULT_MODEL)) {
    this.#o = o;
    this.model = model;
    this.hooks = o.testHooks ?? {};
    this.name = o.name ?? `worker-${process.pid}-${randomUUID().slice(0, 8)}`;
    this.#agent = new NixlAgent(this.name, { engine: o.engine });
    this.blocks = new BlockStore(this.#agent, model.geometry, o.blocks ?? 512, o);
    this.holds = new HoldTable({ stats: this.stats, blocks: this.blocks, poisonFreed: this.hooks.poisonFreed });
    this.secret = kvSecret(o);
    const skew = this.hooks.clockSkewMs ?? 0;
    this.#now = () => performance.now() + skew;
    const handoff = {
      name: this.name,
      agent: this.#agent,
      layout: this.blocks.layout(this.name),
      model,
      stats: this.stats,
      wire: o.wire,
      leaseMs: o.leaseMs,
      secret: this.secret,
      now: this.#now,
      hooks: this.hooks,
      pushTimeoutMs: o.pushTimeoutMs,
    };
    this.handoff = handoffFor(o.kvMode, handoff, new PullHandoff(handoff));
    const { puller, tracker } = this.handoff.pull;
    const active = () => this.#active;
    this.metrics = WorkerMetrics.create(this.modelId, puller, tracker, this.blocks, this.stats, active);
    if (o.bidirectionalKv) this.turns = this.#turnKv(o);
  }

  #turnKv(o: WorkerOptions): TurnKv {
    const share = o.heldTurnsShare ?? 0.5; // checked by startWorker
    return new TurnKv({
      name: this.name,
      wire: o.wire,
      secret: this.secret,
      model: this.model,
      blocks: this.blocks,
      holds: this.holds,
      pull: this.handoff.pull,
      ttlMs: o.decoderKvTtlMs ?? DEFAULT_TURN_TTL_MS,
      maxHeldBlocks: Math.floor(share * this.blocks.size),
      recomputeThreshold: o.kvRecomputeThreshold,
      reuseHandshakeMs: o.kvReuseHandshakeMs ?? DEFAULT_REUSE_HANDSHAKE_MS,
      tamperKv: this.hooks.tamperKv,
    });
  }

  /** The model's name in answers and /v1/models. */
  get modelId(): string {
    return this.servedModelNames[0];
  }

  /** Where its metrics listener serves /metrics and /health (metricsPort), or undefined. */
  get metricsUrl(): string | undefined {
    return this.#metricsPort?.url;
  }

  /** Every name it answers to. */
  get servedModelNames(): readonly string[] {
    return this.#o.servedModelNames?.length ? this.#o.servedModelNames : [this.model.id];
  }

  /** What /health (and a ZeroMQ HEALTH reply) says: the proxy pairs workers and checks max_tokens by it. */
  healthInfo(): ReturnType<FrontHandler['healthInfo']> {
    const len = this.model.contextSize;
    return {
      name: this.name,
      model: this.modelId,
      ...(len ? { max_model_len: len } : {}),
      free_blocks: this.freeBlocks,
      num_requests_waiting: this.blocks.waiting,
      served_model_names: [...this.servedModelNames],
      ...(this.metricsUrl ? { metrics_url: this.metricsUrl } : {}),
      ...this.handoff.health(),
      ...this.kvEvents?.health(),
      ...this.fleet?.health(),
    };
  }

  /**
   * Frees at once the blocks a prefilled request holds, when its decode will
   * not read them (it failed, or the client went away): the proxy says so.
   */
  releaseHold(remoteRequestId: unknown): boolean {
    if (typeof remoteRequestId !== 'string')
      throw failure('invalid_request_error', "'remote_request_id' must be a string");
    return this.holds.releaseHold(remoteRequestId);
  }

  /**
   * Frees the holds a request (the proxy's request id) made here, its turn
   * held for a next turn included, and makes its prefills still running give
   * theirs up: the proxy's client went away before the answer, with the
   * hold's id, reached the proxy. Returns how many holds and prefills it found.
   */
  releaseRequest(requestId: unknown): number {
    if (typeof requestId !== 'string') throw failure('invalid_request_error', "'request_id' must be a string");
    return this.holds.releaseRequest(requestId);
  }

  /** Why this worker cannot serve now (its model cannot), or undefined: /health answers 503 with it. */
  unhealthy(): string | undefined {
    return this.model.unhealthy?.();
  }

  /** KV blocks free right now. */
  get freeBlocks(): number {
    return this.blocks.available;
  }

  /** Serves: the side channel, then the HTTP or ZeroMQ front. */
  async start(): Promise<this> {
    const host = this.#o.host ?? '127.0.0.1';
    const { tracker } = this.handoff.pull;
    this.#side = await servePrefill({
      ranks: [{ agent: this.#agent, layout: this.blocks.layout(this.name), leaseBoard: tracker.board }],
      compatibilityHash: this.handoff.sideHash(this.model.compatibilityHash),
      host: this.#o.sideChannelHost ?? host,
      port: this.#o.sideChannelPort ?? 0,
      wire: this.#o.wire,
      logger: { warn() {} },
      // The clock its v12 replies carry: the one remote_blocks_expiry_time is on.
      clock: () => this.#now() / 1000,
    });
    this.handoff.start(this.#side);
    this.kvEvents = await KvEvents.start(this.#o.kvEvents, this.model, host, this.blocks.size);
    const maxBodyBytes = this.#o.maxBodyBytes ?? 1 << 20;
    if ((this.#o.transport ?? 'http') === 'http') {
      const h = await serveHttp(this, {
        host,
        port: this.#o.port ?? 0,
        maxBodyBytes,
        requestTimeoutMs: this.#o.requestTimeoutMs ?? 30_000,
      });
      this.#http = h.server;
      this.address = h.url;
    } else {
      this.#zmq = await ZmqFront.bind(this, this.#o.zmqAddr ?? `tcp://${host}:*`, maxBodyBytes);
      this.address = this.#zmq.address;
    }
    this.#metricsPort = await MetricsPort.open(this, host, this.#o);
    if (this.#o.etcd) this.fleet = await new FleetRegistration(this.#fleetView(), this.#o.etcd, this.#o.logger).join();
    return this;
  }

  /** What its etcd record reports: load is requests in progress plus KV held for a decode. */
  #fleetView() {
    const w = this;
    return {
      name: w.name,
      address: w.address,
      transport: w.#o.transport ?? 'http',
      modelId: w.modelId,
      servedModelNames: w.servedModelNames,
      get freeBlocks() {
        return w.freeBlocks;
      },
      totalBlocks: w.blocks.size,
      kvEvents: w.kvEvents?.info,
      get load() {
        // A request waiting for blocks counts twice: in progress, and queued behind a full cache.
        return w.#active + w.blocks.waiting + w.holds.count();
      },
    };
  }

  /** Counts a failed request; the error as the front answers it. */
  failed(e: unknown): HttpError {
    this.stats.failed++;
    return e instanceof HttpError ? e : failure('internal_error', (e as Error)?.message ?? String(e));
  }

  /**
   * One request from a front, in its own span (a child of the proxy's stage
   * span when traceparent names one). Throws HttpError.
   */
  async handle(q: WorkerRequest): Promise<void> {
    const span = startSpan('worker.request', {
      kind: 'server',
      parent: contextFromTraceparent(q.traceparent),
      attributes: { 'http.route': q.path, 'nixl_node.worker': this.name, 'nixl_node.request_id': q.requestId },
    });
    this.#active++;
    const log = this.#o.logger ?? silentLogger;
    const t0 = performance.now();
    const fields = () => ({ request_id: q.requestId, route: q.path, ms: Math.round(performance.now() - t0) });
    try {
      await serve(this, { ...q, sink: this.metrics?.track(q.sink) ?? q.sink }, span);
      log.debug({ ...fields(), status: 200 }, 'request');
    } catch (e) {
      const h = httpErrorOf(e, q.signal);
      span.fail(h);
      span.setAttribute('http.response.status_code', h.status);
      const line = { ...fields(), status: h.status, code: h.code, error: h.message };
      if (h.status >= 500) log.warn(line, 'request failed');
      else log.info(line, 'request refused');
      throw h;
    } finally {
      this.#active--;
      span.end();
    }
  }

  /** Stops: fronts closed, requests aborted, agent and model freed. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    // Out of the fleet first, then what is in progress (and KV held for a decode) finishes.
    await this.fleet?.leave(() => this.#active === 0 && this.holds.count('prefill') === 0);
    this.blocks.close();
    this.metrics?.close();
    this.#zmq?.close();
    if (this.#http) {
      this.#http.closeAllConnections();
      await new Promise((r) => this.#http!.close(r));
    }
    await this.#metricsPort?.close();
    await this.#side?.close();
    await this.handoff.close();
    this.#agent.close();
    await this.kvEvents?.close();
    await this.model.close();
  }
}

/** The deployment's secret: the option, else NIXL_NODE_KV_SECRET, else none. */
function kvSecret(o: WorkerOptions): string | undefined {
  return o.kvSecret ?? process.env.NIXL_NODE_KV_SECRET ?? undefined;
}

/** The longest wait a Node.js timer takes (longer ones fire at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Bidirectional KV's options, checked at start, before a model loads or an
 * agent is made: out of range, each decode would compute its answer and then
 * fail holding the turn (the blocks it took kept), or each prefill's
 * handshake with it time out at once.
 */
function checkTurnOptions(o: WorkerOptions): void {
  const bad = (k: string, v: unknown, what: string) =>
    new NixlError(`${k} must be ${what}, got ${v}`, 'NIXL_ERR_INVALID_PARAM');
  const ttl = o.decoderKvTtlMs;
  if (ttl !== undefined && !(Number.isFinite(ttl) && ttl > 0))
    throw bad('decoderKvTtlMs', ttl, 'a positive number of ms');
  // One timer waits for the handshake.
  const hs = o.kvReuseHandshakeMs;
  if (hs !== undefined && !(Number.isFinite(hs) && hs > 0 && hs <= MAX_TIMER_MS))
    throw bad('kvReuseHandshakeMs', hs, `a positive number of ms, at most ${MAX_TIMER_MS}`);
  const share = o.heldTurnsShare;
  if (share !== undefined && !(share >= 0 && share <= 1))
    throw new NixlError(`heldTurnsShare must be from 0 to 1, got ${share}`, 'NIXL_ERR_INVALID_PARAM');
  const t = o.kvRecomputeThreshold;
  if (t !== undefined && !(Number.isSafeInteger(t) && t >= 0))
    throw bad('kvRecomputeThreshold', t, 'a count of tokens');
}

/** Loads the model the options name, then starts the worker. */
export async function startWorker(o: WorkerOptions = {}): Promise<Worker> {
  wireProfile(o.wire); // a bad profile fails before anything starts
  compileBodySchemas(); // at startup, not on the first request
  checkTurnOptions(o);
  checkBlockQueueOptions(o);
  parseKvEventsConfig(o.kvEvents); // a bad config fails before anything starts
  checkKvMode(o);
  const model = await loadModel(o);
  let w: Worker;
  try {
    w = new Worker(o, model);
  } catch (e) {
    await model.close();
    throw e;
  }
  try {
    return await w.start();
  } catch (e) {
    await w.close();
    throw e;
  }
}

/** The GGUF the options name, else the synthetic model. */
async function loadModel(o: WorkerOptions): Promise<ServingModel> {
  if (typeof o.model !== 'string') return new SyntheticModel(o.model ?? DEFAULT_MODEL);
  const blockBytes = o.blockBytes ?? 64 << 10;
  return LlamaModel.load({
    modelPath: o.model,
    threads: o.threads,
    contextSize: o.contextSize,
    parallel: o.parallel,
    batchSize: o.batchSize,
    prefixCache: o.prefixCache,
    blockBytes,
    poolBytes: (o.blocks ?? 512) * blockBytes,
    kvSecret: kvSecret(o),
    stateDir: o.stateDir,
  });
}
