// A Node inference worker for the serving proxy: the stage logic between a
// front (worker-http.ts: OpenAI-compatible HTTP; worker-zmq.ts: the proxy's
// ZeroMQ protocol) and a model (models/: the synthetic one, or a GGUF through
// node-llama-cpp). One worker can act as encoder, prefill and decode:
//   prefill  kv_transfer_params.do_remote_decode: evaluate the prompt, put its
//            KV into free blocks of the registered pool, answer with
//            kv_transfer_params (wire profile), hold the blocks until the
//            decode side's read (PrefillTracker) or the lease runs out;
//   decode   kv_transfer_params with remote_block_ids: pull the KV
//            (KvPuller.pullFromParams), have the model check it (synthetic:
//            every byte; llama: the state's envelope) and generate from it,
//            streamed or not;
//   encode   a request with images: digest them (what an encoder worker would
//            cache for the prefill), answer with a count;
//   neither  evaluate and generate here (an aggregated worker).
import { randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import { type EngineKind, NixlAgent } from '../../agent';
import { DescList, allocate } from '../../descriptors';
import type { HandshakeServer } from '../../handshake/types';
import type { WireName } from '../../handshake/model';
import { buildKvTransferParams, parseKvTransferParams, wireProfile } from '../../handshake/wire';
import { KvPuller, type PullError } from '../../kv/pull/puller';
import { LeaseBoard } from '../../kv/lease-board';
import { PrefillTracker, servePrefill } from '../../kv/prefill';
import type { KvLayout } from '../../kv/layout';
import { signKvTransferParams, verifyKvTransferParams } from '../../kv/params-auth';
import { type SpanLike, contextFromTraceparent, startSpan } from '../../tracing';
import { BlockPool, type BlockQueueOptions, checkBlockQueueOptions, tooLarge } from './blocks';
import type { FrontHandler, RequestHints, Sink } from './fronts/front';
import { HttpError, countImages } from '../api/http';
import { tamperEnvelope, type Tamper } from '../models/kv-state';
import { LlamaModel } from '../models/llama';
import { SyntheticModel } from '../models/synthetic';
import { DEFAULT_MODEL, type SyntheticModelSpec } from '../models/synthetic-kv';
import {
  type BlockView,
  type ChatMessage,
  type Generated,
  type GenerationRequest,
  type KvBinding,
  KvRejected,
  ModelRequestError,
  type PrefilledKv,
  type ServingModel,
} from '../models/types';
import { chunkBody, completionBody, usageBody } from '../api/openai';
import { checkRequestBody, compileBodySchemas } from '../api/request-checks';
import { PROMPT_TOKENS } from './fronts/generate-route';
import { endAnswer } from './stream-end';
import { ReleasedEarly } from './released-early';
import { type Logger, silentLogger } from '../log';
import { ModelNotFound } from '../api/openai';
import { WORKER_ROUTES } from '../api/routes';
import { serveHttp } from './fronts/http';
import { ZmqFront } from './fronts/zmq';
import { NixlError } from '../../errors';
import { type FleetJoinOptions, FleetRegistration } from '../fleet/registry';
import { DEFAULT_TURN_TTL_MS, namesPreviousTurn } from '../../kv/turn-params';
import { DEFAULT_REUSE_HANDSHAKE_MS, type HeldTurn, type Reuse, TurnKv } from './turns';
import { type KvMode, PushServing, pushBinding, pushHash } from './push-serving';
import { KvEvents, type KvEventsConfig, parseKvEventsConfig } from './kv-events';
import { WorkerMetrics } from './vllm-metrics';
import { MetricsPort } from './fronts/metrics-port';

/** Options of a worker. */
/** kvWaitMs, kvQueueMax: how long and how many requests wait for KV blocks when the cache is full (blocks.ts). */
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
  /** Test hooks: a prefill answers, a decode starts its pull, only after this long. */
  stallPrefillMs?: number;
  stallDecodeMs?: number;
  /** Test hook: blocks freed by lease are overwritten at once (as a reused block would be). */
  poisonFreed?: boolean;
  /** Test hook: this worker's monotonic clock runs this far ahead (negative: behind) of the process's. */
  clockSkewMs?: number;
  /** Test hook (GGUF): a prefill damages each state it puts into blocks, this way (a bidirectional decode, each turn it holds). */
  tamperKv?: Tamper;
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
  /** Publishes its prefix cache as vLLM's KV events (vLLM --kv-events-config; docs/kv-events.md). */
  kvEvents?: KvEventsConfig | string;
}

/** A worker's counters. */
export interface WorkerStats {
  prefills: number;
  decodes: number;
  encodes: number;
  aggregated: number;
  failed: number;
  verifiedBytes: number;
  badBytes: number;
  /** Decode: KV it was given and refused to load (wrong bytes, another model, truncated, corrupted). */
  rejectedKv: number;
  freedByRead: number;
  freedByLease: number;
  /** Decode: pulls refused or failed because the prefill's lease ran out (or would have) first. */
  pullsExpired: number;
  /** Prefill: reads reported after a request's lease ran out. */
  lateReads: number;
  /** Prefill: holds released early because the proxy said the decode would not read them. */
  abortedHolds: number;
  /** Prefill (push): pushes that failed, never retried (a registration refused, a WRITE failed); blocks freed. */
  failedPushes: number;
  /** ZeroMQ: answers dropped because their reply_to is not an address a PUSH socket can connect to. */
  repliesDropped: number;
  /** ZeroMQ: messages dropped unanswered: unreadable (not two frames, not a msgpack map) or with no usable reply_to. */
  messagesDropped: number;
  /** Time spent taking KV out of the model into blocks (prefill), pulling it (decode), putting it back in (decode), ms. */
  kvSaveMs: number;
  kvPullMs: number;
  kvLoadMs: number;
  /** Prefill (GGUF): prefills that reused a cached prefix, prompt tokens taken from one, and prompt tokens evaluated. */
  prefixHits: number;
  prefixReusedTokens: number;
  prefillEvaluatedTokens: number;
  /** Prefill: time in the model's prefill (evaluating and taking the KV out), ms. */
  prefillMs: number;
}

export type { RequestHints, Sink } from './fronts/front';

/**
 * A Node inference worker: encoder, prefill, decode or aggregated, with the
 * synthetic model or a GGUF; KV moves with servePrefill, PrefillTracker and KvPuller.
 */
export class Worker implements FrontHandler {
  readonly name: string;
  readonly stats: WorkerStats = {
    prefills: 0,
    decodes: 0,
    encodes: 0,
    aggregated: 0,
    failed: 0,
    verifiedBytes: 0,
    badBytes: 0,
    rejectedKv: 0,
    freedByRead: 0,
    freedByLease: 0,
    pullsExpired: 0,
    lateReads: 0,
    abortedHolds: 0,
    failedPushes: 0,
    repliesDropped: 0,
    messagesDropped: 0,
    kvSaveMs: 0,
    kvPullMs: 0,
    kvLoadMs: 0,
    prefixHits: 0,
    prefixReusedTokens: 0,
    prefillEvaluatedTokens: 0,
    prefillMs: 0,
  };
  /** HTTP: the base URL; ZMQ: the address to PUSH to. */
  address = '';
  readonly model: ServingModel;
  readonly #o: WorkerOptions;
  readonly #agent: NixlAgent;
  readonly #mem: Buffer;
  readonly #blocks: BlockPool;
  readonly #layout: KvLayout;
  readonly #puller: KvPuller;
  readonly #tracker: PrefillTracker;
  /** This worker's monotonic clock, ms (skewed by the test hook). */
  readonly #now: () => number;
  readonly #secret: string | undefined;
  /** Blocks held for each prefilled request until its read or lease. */
  readonly #held = new Map<string, number[]>();
  /**
   * By the request id the proxy sent: the holds made and the prefills still
   * running for it (releaseRequest frees both).
   */
  readonly #holdsOf = new Map<string, Set<string>>();
  readonly #prefilling = new Map<string, Set<{ released: boolean }>>();
  /** Request ids released before any prefill (or held turn) of theirs was made here. */
  readonly #releasedEarly = new ReleasedEarly();
  #side?: HandshakeServer;
  /** Push mode's receiver and sender (kvMode 'push'). */
  #push?: PushServing;
  #http?: http.Server;
  #zmq?: ZmqFront;
  #metricsPort?: MetricsPort;
  #seq = 0;
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
    this.name = o.name ?? `worker-${process.pid}-${randomUUID().slice(0, 8)}`;
    const { layers, blockBytes, tokensPerBlock } = model.geometry;
    const blocks = o.blocks ?? 512;
    this.#blocks = new BlockPool(blocks, o);
    this.#agent = new NixlAgent(this.name, { engine: o.engine });
    const regionBytes = blocks * blockBytes;
    this.#mem = allocate(layers * regionBytes);
    this.#agent.registerMemory(this.#mem);
    const base = DescList.from(this.#mem).addr(0);
    this.#layout = {
      engineId: this.name,
      tpSize: 1,
      tpRank: 0,
      numBlocks: blocks,
      blockSize: tokensPerBlock,
      blockLens: Array(layers).fill(blockBytes),
      baseAddrs: Array.from({ length: layers }, (_, l) => base + BigInt(l * regionBytes)),
      kvCacheLayout: 'LBHNC',
      totalNumKvHeads: 8,
    };
    this.#secret = o.kvSecret ?? process.env.NIXL_NODE_KV_SECRET ?? undefined;
    this.#puller = new KvPuller({
      agent: this.#agent,
      layout: this.#layout,
      wire: o.wire,
      kvLeaseMs: o.leaseMs,
      paramsSecret: this.#secret,
      // A prefill of another model fails at the handshake, before any read.
      expectedHash: model.compatibilityHash,
    });
    const skew = o.clockSkewMs ?? 0;
    this.#now = () => performance.now() + skew;
    this.#tracker = new PrefillTracker({
      agent: this.#agent,
      tpSize: 1,
      wire: o.wire,
      leaseMs: o.leaseMs,
      now: this.#now,
      logger: { warn() {} },
      // nixl-node decodes confirm each read against it; vLLM decodes never look.
      board: new LeaseBoard(),
    });
    this.#tracker.sinks.add({
      released: (r) => {
        if (r.reason === 'read') this.stats.freedByRead++;
        else if (r.reason === 'aborted') this.stats.abortedHolds++;
        else this.stats.freedByLease++;
      },
      unrecognized: () => {},
      lateRead: () => this.stats.lateReads++,
    });
    const active = () => this.#active;
    this.metrics = WorkerMetrics.create(this.modelId, this.#puller, this.#tracker, this.#blocks, this.stats, active);
    const share = o.heldTurnsShare ?? 0.5; // checked by startWorker
    if (o.bidirectionalKv)
      this.turns = new TurnKv({
        name: this.name,
        wire: o.wire,
        secret: this.#secret,
        model,
        tracker: this.#tracker,
        puller: this.#puller,
        side: () => this.#side!,
        take: (n) => (n <= this.#blocks.available ? (this.#blocks.take(n) ?? undefined) : undefined),
        give: (ids) => this.#blocks.give(ids),
        view: (ids) => this.#view(ids),
        releasedEarly: (id) => this.#releasedEarly.has(id),
        ttlMs: o.decoderKvTtlMs ?? DEFAULT_TURN_TTL_MS,
        maxHeldBlocks: Math.floor(share * this.#blocks.size),
        recomputeThreshold: o.kvRecomputeThreshold,
        reuseHandshakeMs: o.kvReuseHandshakeMs ?? DEFAULT_REUSE_HANDSHAKE_MS,
        // A decode's held turns are damaged too (GGUF: the next prefill must refuse them).
        tamper: o.tamperKv
          ? (view, n) => tamperEnvelope(view, n, model.geometry.blockBytes, o.tamperKv!, this.#secret)
          : undefined,
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
      num_requests_waiting: this.#blocks.waiting,
      served_model_names: [...this.servedModelNames],
      ...(this.metricsUrl ? { metrics_url: this.metricsUrl } : {}),
      ...this.#kvInfo(),
      ...this.kvEvents?.health(),
      ...this.fleet?.health(),
    };
  }

  /**
   * Frees at once the blocks a prefilled request holds, when its decode will
   * not read them (it failed, or the client went away): the proxy says so.
   */
  releaseHold(remoteRequestId: unknown): boolean {
    if (typeof remoteRequestId !== 'string') throw new HttpError(400, "'remote_request_id' must be a string");
    return this.#abortHold(remoteRequestId);
  }

  /**
   * Frees the holds a request (the proxy's request id) made here, its turn
   * held for a next turn included, and makes its prefills still running give
   * theirs up: the proxy's client went away before the answer, with the
   * hold's id, reached the proxy. Returns how many holds and prefills it found.
   */
  releaseRequest(requestId: unknown): number {
    if (typeof requestId !== 'string') throw new HttpError(400, "'request_id' must be a string");
    let n = 0;
    for (const p of this.#prefilling.get(requestId) ?? []) {
      p.released = true;
      n++;
    }
    for (const id of [...(this.#holdsOf.get(requestId) ?? [])]) if (this.#abortHold(id)) n++;
    n += this.turns?.releaseRequest(requestId) ?? 0;
    if (n === 0) this.#releasedEarly.add(requestId);
    return n;
  }

  /** What a push proxy sends a decode up front: where this worker's KV is (vLLM DEMO1's --prefill-* flags). */
  #kvInfo() {
    const mode = this.#o.kvMode ?? 'pull';
    if (mode !== 'push' || !this.#side) return { kv_mode: mode };
    const { host, basePort } = this.#side;
    return { kv_mode: mode, kv_engine_id: this.name, kv_host: host, kv_port: basePort, tp_size: 1, pp_size: 1 };
  }

  /** Frees a prefill's hold (pull or push) now; false when there is none. */
  #abortHold(id: string): boolean {
    return this.#tracker.abort(id) || (this.#push?.sender.abort(id) ?? false);
  }

  /** Why this worker cannot serve now (its model cannot), or undefined: /health answers 503 with it. */
  unhealthy(): string | undefined {
    return this.model.unhealthy?.();
  }

  /** KV blocks free right now. */
  get freeBlocks(): number {
    return this.#blocks.available;
  }

  /** Block `ids[b]` of layer l: a request's logical block b. */
  #view(ids: readonly number[]): BlockView {
    const { blockBytes } = this.model.geometry;
    return (b, l) => {
      if (b < 0 || b >= ids.length)
        throw new NixlError(`block ${b} of a request of ${ids.length}`, 'NIXL_ERR_INVALID_PARAM');
      const at = (l * this.#blocks.size + ids[b]) * blockBytes;
      return this.#mem.subarray(at, at + blockBytes);
    };
  }

  /** Serves: the side channel, then the HTTP or ZeroMQ front. */
  async start(): Promise<this> {
    const host = this.#o.host ?? '127.0.0.1';
    const sideHost = this.#o.sideChannelHost ?? host;
    this.#side = await servePrefill({
      ranks: [{ agent: this.#agent, layout: this.#layout, leaseBoard: this.#tracker.board }],
      compatibilityHash:
        this.#o.kvMode === 'push' ? pushHash(this.model.compatibilityHash) : this.model.compatibilityHash,
      host: sideHost,
      port: this.#o.sideChannelPort ?? 0,
      wire: this.#o.wire,
      logger: { warn() {} },
      // The clock its v12 replies carry: the one remote_blocks_expiry_time is on.
      clock: () => this.#now() / 1000,
    });
    if (this.#o.kvMode === 'push')
      this.#push = new PushServing({
        agent: this.#agent,
        layout: this.#layout,
        hash: pushHash(this.model.compatibilityHash),
        host: sideHost,
        port: this.#side.basePort,
        wire: this.#o.wire,
        leaseMs: this.#o.leaseMs,
        receiveTimeoutMs: this.#o.pushTimeoutMs,
        secret: this.#secret,
        transferStats: this.#puller.stats,
      });
    this.kvEvents = await KvEvents.start(this.#o.kvEvents, this.model, host, this.#blocks.size);
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
      totalBlocks: w.#blocks.size,
      kvEvents: w.kvEvents?.info,
      get load() {
        // A request waiting for blocks counts twice: in progress, and queued behind a full cache.
        return w.#active + w.#blocks.waiting + w.#held.size + (w.turns?.held ?? 0);
      },
    };
  }

  /** Counts a failed request; the error as the front answers it. */
  failed(e: unknown): HttpError {
    this.stats.failed++;
    return e instanceof HttpError ? e : new HttpError(500, (e as Error)?.message ?? String(e), 'internal_error');
  }

  /**
   * One request from a front, in its own span (a child of the proxy's stage
   * span when traceparent names one). Throws HttpError.
   */
  async handle(
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    traceparent?: unknown,
    hints: RequestHints = {},
  ): Promise<void> {
    const span = startSpan('worker.request', {
      kind: 'server',
      parent: contextFromTraceparent(traceparent),
      attributes: { 'http.route': path, 'nixl_node.worker': this.name, 'nixl_node.request_id': requestId },
    });
    this.#active++;
    const log = this.#o.logger ?? silentLogger;
    const t0 = performance.now();
    const fields = () => ({ request_id: requestId, route: path, ms: Math.round(performance.now() - t0) });
    try {
      await this.#serve(path, body, requestId, signal, this.metrics?.track(sink) ?? sink, span, hints);
      log.debug({ ...fields(), status: 200 }, 'request');
    } catch (e) {
      const h = asHttpError(e, signal);
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

  async #serve(
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    span: SpanLike,
    hints: RequestHints,
  ) {
    const arrivedMs = performance.now();
    if (path !== '/v1/completions' && path !== '/v1/chat/completions') throw new HttpError(404, `no route ${path}`);
    checkRequestBody(WORKER_ROUTES, path, body, 'worker');
    if (typeof body.model === 'string' && !this.servedModelNames.includes(body.model))
      throw new ModelNotFound(body.model, this.servedModelNames);
    // The name asked for, when it is one of ours (as vLLM answers).
    const modelName = typeof body.model === 'string' ? body.model : this.modelId;
    const req = generationRequest(path, body);
    // A decode's model makes the answered turn's KV as it decodes (GGUF), for TurnKv.keep.
    if (this.turns) req.keepTurn = true;
    const reserve = Number(hints.decodeMaxTokens);
    if (Number.isSafeInteger(reserve) && reserve > 0) req.decodeMaxTokens = reserve;
    const kvp = body.kv_transfer_params as Record<string, unknown> | undefined;
    const answer = new Answer(requestId, modelName, req.chat, body, sink);

    if (countImages(body) > 0 && kvp === undefined) {
      span.setAttribute('nixl_node.role', 'encode');
      this.stats.encodes++;
      sink.end(200, { id: requestId, object: 'encode', model: modelName, mm_items: countImages(body) });
      return;
    }
    const known = this.model.blocksFor(req);
    if (known !== undefined) this.#fits(known);
    if (kvp?.do_remote_decode === true) {
      span.setAttribute('nixl_node.role', 'prefill');
      await this.#prefill(req, requestId, signal, sink, span, body);
      return;
    }
    if (kvp !== undefined && kvp.remote_engine_id === this.name) {
      // Prefilled here (one worker in both pools): the KV is in our own blocks; read it in place.
      span.setAttribute('nixl_node.role', 'decode-in-place');
      let p: ReturnType<typeof parseKvTransferParams>;
      try {
        if (this.#secret !== undefined) verifyKvTransferParams(kvp, this.#secret);
        p = parseKvTransferParams(kvp, this.#o.wire);
      } catch (e) {
        throw new HttpError(400, `kv_transfer_params: ${(e as Error).message}`);
      }
      const held = this.#held.get(p.remoteRequestId);
      // Only blocks this worker holds for exactly that request (anything else is forged or expired).
      if (!held || held.join() !== p.remoteBlockIds[0]?.join())
        throw new HttpError(
          400,
          `request '${p.remoteRequestId}' holds no such blocks here (expired, or not prefilled here)`,
        );
      try {
        const g = await this.#decode(req, held, answer, signal, () => {}, bindingOf(p));
        this.stats.decodes++;
        const next = signal.aborted ? undefined : this.turns?.keep(req, answer.whole, g.turn, { requestId, signal });
        answer.finish(
          g,
          { worker: this.name, kv_blocks: held.length, kv_moved: false, kv_mode: 'pull', ...g.info },
          next,
        );
      } finally {
        this.#tracker.release(p.remoteRequestId);
      }
      return;
    }
    if (kvp === undefined) {
      span.setAttribute('nixl_node.role', 'aggregated');
      const g = await this.model.generate(req, answer.text, signal);
      this.stats.aggregated++;
      answer.finish(g, { worker: this.name, kv_blocks: 0, kv_moved: false, ...g.info });
      return;
    }
    if (this.#isPush(kvp)) {
      span.setAttribute('nixl_node.role', 'decode');
      span.setAttribute('nixl_node.kv_mode', 'push');
      await this.#pushDecode(req, kvp, known, answer, signal);
      return;
    }
    // Decode: the KV comes from the prefill named in kv_transfer_params.
    span.setAttribute('nixl_node.role', 'decode');
    this.#fitsContext(req, kvp);
    const n = known ?? remoteBlockCount(kvp, this.#o.wire);
    const ids = await this.#blocks.acquire(n, signal);
    let given = false;
    const give = () => {
      if (!given) this.#blocks.give(ids);
      given = true;
    };
    try {
      if (this.#o.stallDecodeMs) await sleep(this.#o.stallDecodeMs, signal);
      const pulled = performance.now();
      const pull = () =>
        this.#puller.pullFromParams(kvp, {
          traceContext: span.context,
          localBlockIds: ids,
          signal,
          timeoutMs: 30_000,
          issuedAtMs: arrivedMs,
        });
      try {
        await pull().catch((e: PullError) => {
          // The prefill restarted at the address we knew (same side channel):
          // our connection was to its dead incarnation, which the puller has
          // dropped. Once more, from a fresh handshake with the new one.
          if (e.kind !== 'peer-gone' || signal.aborted) throw e;
          return pull();
        });
      } catch (e) {
        const err = e as PullError;
        if (err.kind === 'expired') {
          // Not this worker's fault nor the client's: the proxy prefills again.
          this.stats.pullsExpired++;
          throw new HttpError(503, `KV pull failed (expired): ${err.message}`, 'kv_expired');
        }
        // What the params name does not fit (bad ids, sizes, a layout or a
        // model the peer does not have): the request's fault, not this worker's.
        const refused = err.kind === 'setup' || err.code === 'NIXL_ERR_MISMATCH';
        throw new HttpError(refused ? 400 : 502, `KV pull failed (${err.kind}): ${err.message}`, err.code);
      }
      const pullMs = performance.now() - pulled;
      this.stats.kvPullMs += pullMs;
      // The pull parsed (and, with a secret, verified) these params already.
      const g = await this.#decode(req, ids, answer, signal, give, bindingOf(parseKvTransferParams(kvp, this.#o.wire)));
      this.stats.decodes++;
      const { layers, blockBytes } = this.model.geometry;
      // Bidirectional KV: this turn's KV stays here for the next turn's prefill.
      give();
      const next = signal.aborted ? undefined : this.turns?.keep(req, answer.whole, g.turn, { requestId, signal });
      answer.finish(
        g,
        {
          worker: this.name,
          kv_blocks: n,
          kv_moved: true,
          kv_mode: 'pull',
          kv_bytes: n * layers * blockBytes,
          kv_pull_ms: Math.round(pullMs * 1000) / 1000,
          ...g.info,
        },
        next,
      );
    } finally {
      give();
    }
  }

  /** Whether kv_transfer_params ask for push (a pull worker refuses them); a push worker's default. */
  #isPush(kvp: Record<string, unknown> | undefined): boolean {
    if (kvp === undefined) return false;
    if (kvp.transfer_mode === 'push' && !this.#push)
      throw new HttpError(
        400,
        'this worker moves KV in pull mode; these kv_transfer_params ask for push',
        'kv_mode_mismatch',
      );
    return this.#push !== undefined && (kvp.transfer_mode === 'push' || kvp.transfer_mode === undefined);
  }

  /**
   * Push decode: our blocks are registered with the prefill the params name,
   * which WRITEs into them; once every WRITE came, generate as after a pull.
   */
  async #pushDecode(
    req: GenerationRequest,
    kvp: Record<string, unknown>,
    known: number | undefined,
    answer: Answer,
    signal: AbortSignal,
  ) {
    // A model whose KV is one whole sized by the prompt's tokens (a GGUF's state) computes it.
    const n = known ?? this.#pushBlocks(req);
    const ids = await this.#blocks.acquire(n, signal);
    let given = false;
    const give = () => {
      if (!given) this.#blocks.give(ids);
      given = true;
    };
    const t0 = performance.now();
    const { params, got } = await this.#push!.receive(kvp, ids, signal, give);
    try {
      const pushMs = performance.now() - t0;
      this.stats.kvPullMs += pushMs;
      const binding = pushBinding(params.remoteEngineId, got.requestId);
      const g = await this.#decode(req, ids, answer, signal, give, binding);
      this.stats.decodes++;
      const { layers, blockBytes } = this.model.geometry;
      give();
      answer.finish(g, {
        worker: this.name,
        kv_blocks: n,
        kv_moved: true,
        kv_mode: 'push',
        kv_bytes: n * layers * blockBytes,
        kv_push_ms: Math.round(pushMs * 1000) / 1000,
        ...g.info,
      });
    } finally {
      give();
    }
  }

  /** The blocks a push decode registers, from the prompt (a 4xx, or a typed 502, when the model cannot say). */
  #pushBlocks(req: GenerationRequest): number {
    if (!this.model.pushBlocksFor)
      throw new HttpError(400, 'push mode needs a model that knows its KV blocks from the prompt', 'kv_mode_mismatch');
    try {
      return this.model.pushBlocksFor(req);
    } catch (e) {
      if (!(e instanceof KvRejected)) throw e;
      throw new HttpError(502, `KV push impossible (${e.reason}): ${e.message}`, 'kv_rejected', {
        reason: e.reason,
        nixl_code: e.code,
      });
    }
  }

  async #prefill(
    req: GenerationRequest,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    span: SpanLike,
    body: Record<string, unknown>,
  ) {
    const me = { released: this.#releasedEarly.has(requestId) };
    const running = getOrAdd(this.#prefilling, requestId);
    running.add(me);
    try {
      await this.#prefillOnce(req, requestId, signal, sink, span, me, body);
    } finally {
      running.delete(me);
      if (running.size === 0) this.#prefilling.delete(requestId);
    }
  }

  async #prefillOnce(
    req: GenerationRequest,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    span: SpanLike,
    me: { released: boolean },
    body: Record<string, unknown>,
  ) {
    // Push: a prompt its decode cannot size is refused here as the decode refuses it, before any compute.
    if (this.model.pushBlocksFor && this.#isPush(body.kv_transfer_params as Record<string, unknown> | undefined))
      this.#pushBlocks(req);
    const t0 = performance.now();
    let reuse: Reuse | undefined;
    const kvIn = body.kv_transfer_params as Record<string, unknown> | undefined;
    let kv: PrefilledKv;
    // A model that evaluates from a previous turn's state (GGUF) reads it first.
    if (namesPreviousTurn(kvIn) && this.turns && this.model.wholeTurnReuse)
      ({ kv, reuse } = await this.turns.prefillFrom(kvIn!, req, signal, span));
    else kv = await this.model.prefill(req, signal);
    this.stats.prefillMs += performance.now() - t0;
    const ids = await this.#blocks.acquire(kv.blocks, signal);
    if (namesPreviousTurn(kvIn) && !reuse) {
      try {
        // A previous turn's KV: what is provably this prompt's prefix is read, the rest computed.
        reuse = this.turns ? await this.turns.reuse(kvIn!, req, ids, signal, span) : undefined;
      } catch (e) {
        this.#blocks.give(ids);
        throw e;
      }
      reuse ??= { tokens: 0, blocks: 0, skipped: 'bidirectional-off' };
    }
    const push = this.#isPush(kvIn);
    // Never made of client input: it travels in notifications ("<id>:<n>", "HB:<id>,...").
    let remoteRequestId = `kv-${++this.#seq}-${randomUUID()}`;
    if (push) {
      try {
        // Push: the proxy's transfer_id, which the decode's registration names.
        remoteRequestId = PushServing.offerId(kvIn!);
        if (kv.unpushable)
          throw new HttpError(500, `this prefill's KV cannot be pushed: ${kv.unpushable}`, 'kv_push_unsized');
      } catch (e) {
        this.#blocks.give(ids);
        throw e;
      }
    }
    const t1 = performance.now();
    const binding = push
      ? pushBinding(this.name, remoteRequestId)
      : { engineId: this.name, requestId: remoteRequestId, blockIds: ids };
    kv.writeTo(this.#view(ids), binding, reuse?.blocks);
    this.stats.kvSaveMs += (kv.saveMs ?? 0) + performance.now() - t1;
    if (this.#o.tamperKv)
      tamperEnvelope(this.#view(ids), ids.length, this.model.geometry.blockBytes, this.#o.tamperKv, this.#secret);
    this.#held.set(remoteRequestId, ids);
    const holds = getOrAdd(this.#holdsOf, requestId);
    holds.add(remoteRequestId);
    // The hold outlives this request's span: it ends when the blocks go back.
    const hold = startSpan('kv.hold', {
      parent: span.context,
      attributes: { 'nixl_node.remote_request_id': remoteRequestId, 'nixl_node.blocks': ids.length },
    });
    // (Push: the test hook holds the offer back, so a WRITE comes only after it.)
    if (push && this.#o.stallPrefillMs) await sleep(this.#o.stallPrefillMs, signal);
    const held = push
      ? this.#push!.offer(remoteRequestId, ids, kv.whole).then((r) => {
          if (r.reason === 'written') this.stats.freedByRead++;
          else if (r.reason === 'aborted') this.stats.abortedHolds++;
          else if (r.reason === 'failed') this.stats.failedPushes++;
          else this.stats.freedByLease++;
          return { reason: r.reason === 'written' ? 'read' : r.reason };
        }, failedOffer)
      : this.#tracker.expect(remoteRequestId, ids);
    void held.then((r) => {
      hold.setAttribute('nixl_node.release_reason', r.reason === 'expired' ? 'lease' : r.reason);
      hold.end();
      this.#held.delete(remoteRequestId);
      holds.delete(remoteRequestId);
      if (holds.size === 0 && this.#holdsOf.get(requestId) === holds) this.#holdsOf.delete(requestId);
      if (r.reason !== 'read' && this.#o.poisonFreed) {
        const view = this.#view(ids);
        for (let b = 0; b < ids.length; b++) for (let l = 0; l < this.model.geometry.layers; l++) view(b, l).fill(0xa5);
      }
      this.#blocks.give(ids);
    });
    if (this.#o.stallPrefillMs && !push) await sleep(this.#o.stallPrefillMs, signal);
    if (signal.aborted || me.released) {
      // Nobody will get the params, so nobody will read the blocks.
      this.#abortHold(remoteRequestId);
      throw new HttpError(499, 'the proxy went away', 'aborted');
    }
    this.stats.prefills++;
    const reused = Number(kv.info?.prefix_reused_tokens ?? 0);
    if (reused > 0) this.stats.prefixHits++;
    this.stats.prefixReusedTokens += reused;
    this.stats.prefillEvaluatedTokens += Number(kv.info?.tokens_evaluated ?? 0);
    const params = push
      ? this.#push!.params({
          engineId: this.name,
          requestId: remoteRequestId,
          host: this.#side!.host,
          port: this.#side!.basePort,
          tokens: kv.promptTokens,
        })
      : buildKvTransferParams(
          {
            remoteBlockIds: [ids],
            remoteEngineId: this.name,
            remoteRequestId,
            remoteHost: this.#side!.host,
            remotePort: this.#side!.basePort,
            tpSize: 1,
            remoteNumTokens: kv.promptTokens,
            // When the tracker frees the blocks unless read, on the clock the
            // side channel sends (performance.now, seconds), as vLLM does.
            remoteBlocksExpiryTime: expirySeconds(this.#tracker, remoteRequestId),
          },
          this.#o.wire,
        );
    // Streamed (a client that asked to): the last chunk carries the params.
    endAnswer(
      sink,
      {
        ...completionBody(requestId, this.model.id, req.chat, '', 'length', { prompt: kv.promptTokens, completion: 0 }),
        kv_transfer_params: this.#secret === undefined ? params : signKvTransferParams(params, this.#secret),
        // The proxy may release the hold early (POST /v1/kv/release, or RELEASE over ZeroMQ).
        nixl_node: {
          ...kv.info,
          worker: this.name,
          kv_release: true,
          ...(reuse ? { kv_reused_tokens: reuse.tokens } : {}),
          ...(reuse?.skipped ? { kv_reuse_skipped: reuse.skipped } : {}),
        },
      },
      body,
    );
  }

  /**
   * Generates from the KV in blocks ids, made for the request `binding` names;
   * a KV the model rejects is a typed 502 (its reason and NixlError code in
   * the error), nothing loaded.
   */
  async #decode(
    req: GenerationRequest,
    ids: readonly number[],
    answer: Answer,
    signal: AbortSignal,
    blocksRead: () => void,
    binding: KvBinding,
  ) {
    try {
      const g = await this.model.decode(
        req,
        { view: this.#view(ids), blocks: ids.length, binding, blocksRead },
        answer.text,
        signal,
      );
      this.stats.verifiedBytes += Number(g.info.verified_bytes ?? 0);
      this.stats.kvLoadMs += Number(g.info.kv_load_ms ?? 0);
      return g;
    } catch (e) {
      if (!(e instanceof KvRejected)) throw e;
      this.stats.rejectedKv++;
      this.stats.badBytes += e.badBytes;
      if (e.reason === 'mismatch') throw new HttpError(500, e.message, 'kv_mismatch');
      throw new HttpError(502, `KV state rejected (${e.reason}): ${e.message}`, 'kv_rejected', {
        reason: e.reason,
        nixl_code: e.code,
      });
    }
  }

  /**
   * A decode's 400 before any pull when the prompt the prefill evaluated
   * (remote_num_tokens) and max_tokens cannot fit the model's context, as
   * one worker answers the same request. Params that do not say (vLLM
   * v0.13) are checked by the model once it reads the KV.
   */
  #fitsContext(req: GenerationRequest, kvp: Record<string, unknown>): void {
    const ctx = this.model.contextSize;
    if (ctx === undefined) return;
    let prompt: number | null = null;
    try {
      prompt = parseKvTransferParams(kvp, this.#o.wire).remoteNumTokens;
    } catch {
      return; // the pull says what is wrong with them
    }
    if (prompt !== null && prompt + req.maxTokens > ctx)
      throw new HttpError(
        400,
        `this model's context holds ${ctx} tokens; the request needs ${prompt + req.maxTokens} ` +
          `(${prompt} in the prompt, ${req.maxTokens} to generate)`,
      );
  }

  /** A 400 (kv_request_too_large) when a request's KV cannot fit this worker's cache even when empty. */
  #fits(n: number): void {
    if (n > this.#blocks.size) throw tooLarge(n, this.#blocks.size);
  }

  /** Stops: fronts closed, requests aborted, agent and model freed. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    // Out of the fleet first, then what is in progress (and KV held for a decode) finishes.
    await this.fleet?.leave(() => this.#active === 0 && this.#held.size === 0);
    this.#blocks.close();
    this.metrics?.close();
    this.#zmq?.close();
    if (this.#http) {
      this.#http.closeAllConnections();
      await new Promise((r) => this.#http!.close(r));
    }
    await this.#metricsPort?.close();
    await this.#side?.close();
    await this.#push?.close();
    await this.#puller.close();
    await this.#tracker.close();
    this.#agent.close();
    await this.kvEvents?.close();
    await this.model.close();
  }
}

/** The request kv_transfer_params name: a state made for another is refused. */
function bindingOf(p: ReturnType<typeof parseKvTransferParams>): KvBinding {
  return { engineId: p.remoteEngineId, requestId: p.remoteRequestId, blockIds: p.remoteBlockIds[0] ?? [] };
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
  // A push worker serves push only, and push never reads a held turn: a decode would evaluate and save every
  // turn again for nobody (vLLM refuses the pair at startup too, #46473).
  checkTurnOptions(o);
  checkBlockQueueOptions(o);
  parseKvEventsConfig(o.kvEvents); // a bad config fails before anything starts
  if (o.bidirectionalKv && o.kvMode === 'push')
    throw new NixlError(
      'bidirectional KV (multi-turn) goes with pull mode only: push never reads a held turn (vLLM refuses it too)',
      'NIXL_ERR_NOT_SUPPORTED',
    );
  const blocks = o.blocks ?? 512;
  const blockBytes = o.blockBytes ?? 64 << 10;
  const model =
    typeof o.model === 'string'
      ? await LlamaModel.load({
          modelPath: o.model,
          threads: o.threads,
          contextSize: o.contextSize,
          parallel: o.parallel,
          batchSize: o.batchSize,
          prefixCache: o.prefixCache,
          blockBytes,
          poolBytes: blocks * blockBytes,
          kvSecret: o.kvSecret ?? process.env.NIXL_NODE_KV_SECRET ?? undefined,
          stateDir: o.stateDir,
        })
      : new SyntheticModel(o.model ?? DEFAULT_MODEL);
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

// ---- helpers ----------------------------------------------------------------

/** An answer on its way out: the text as it comes (streamed, or kept), then the end. */
class Answer {
  #text = '';
  /** The whole text, streamed or not (what a decode holds the KV of for the next turn). */
  whole = '';
  readonly #stream: boolean;
  /** One creation time for every chunk of a stream, as OpenAI's. */
  readonly #created = Math.floor(Date.now() / 1000);

  constructor(
    readonly id: string,
    readonly model: string,
    readonly chat: boolean,
    readonly body: Record<string, unknown>,
    readonly sink: Sink,
  ) {
    this.#stream = body.stream === true;
  }

  readonly text = (t: string): void => {
    if (t.length === 0) return;
    this.whole += t;
    this.sink.token?.();
    if (!this.#stream) {
      this.#text += t;
      return;
    }
    this.sink.chunk(chunkBody(this.id, this.#created, this.model, this.chat, t, null));
  };

  /** The end; `turn`: the turn's KV this decode holds (bidirectional KV): its params, on the last chunk when streamed. */
  finish(g: Generated, info: Record<string, unknown>, turn?: HeldTurn): void {
    const usage = { prompt: g.promptTokens, completion: g.completionTokens };
    const next = turn ? { kv_transfer_params: turn.params } : {};
    if (turn) info = { ...info, kv_hold_ms: turn.holdMs };
    if (!this.#stream) {
      this.sink.end(200, {
        ...completionBody(this.id, this.model, this.chat, this.#text, g.finishReason, usage),
        ...next,
        nixl_node: info,
      });
      return;
    }
    this.sink.chunk({
      ...chunkBody(this.id, this.#created, this.model, this.chat, '', g.finishReason),
      ...next,
      nixl_node: info,
    });
    // OpenAI's stream_options.include_usage: one more chunk, with no choices, that carries the usage.
    if ((this.body.stream_options as { include_usage?: unknown } | null)?.include_usage === true) {
      const { choices: _, ...head } = chunkBody(this.id, this.#created, this.model, this.chat, '', null);
      this.sink.chunk({ ...head, choices: [], usage: usageBody(usage) });
    }
    this.sink.end(200);
  }
}

/** The request as a model takes it (the body was checked by checkCompletionRequest). */
function generationRequest(path: string, body: Record<string | symbol, unknown>): GenerationRequest {
  const maxTokens = Number(body.max_tokens ?? body.max_completion_tokens ?? 16);
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > 4096)
    throw new HttpError(400, "'max_tokens' must be an integer from 1 to 4096");
  const stop =
    body.stop === undefined || body.stop === null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop;
  return {
    chat: path === '/v1/chat/completions',
    prompt: typeof body.prompt === 'string' ? body.prompt : '',
    messages: (body.messages as ChatMessage[] | undefined) ?? [],
    ...(body[PROMPT_TOKENS] ? { promptTokens: body[PROMPT_TOKENS] as number[] } : {}),
    maxTokens,
    // OpenAI's and vLLM's default.
    temperature: (body.temperature as number | undefined) ?? 1,
    topP: body.top_p as number | undefined,
    seed: body.seed as number | undefined,
    stop: (stop as string[]).filter((s) => s.length > 0),
  };
}

/** How many blocks kv_transfer_params name (a decode of a model that cannot tell from the prompt). */
function remoteBlockCount(kvp: Record<string, unknown>, wire: WireName | undefined): number {
  try {
    const n = parseKvTransferParams(kvp, wire).remoteBlockIds[0]?.length ?? 0;
    if (n < 1) throw new Error('no remote blocks');
    return n;
  } catch (e) {
    throw new HttpError(400, `kv_transfer_params: ${(e as Error).message}`);
  }
}

function asHttpError(e: unknown, signal: AbortSignal): HttpError {
  if (e instanceof HttpError) return e;
  if (e instanceof ModelRequestError)
    return new HttpError(e.status, e.message, e.status === 499 ? 'aborted' : undefined);
  if (signal.aborted) return new HttpError(499, 'the client went away', 'aborted');
  const err = e as Error & { code?: string };
  return new HttpError(500, err?.message ?? String(e), 'internal_error');
}

function expirySeconds(tracker: PrefillTracker, requestId: string): number | null {
  const ms = tracker.leaseExpiry(requestId);
  return ms === undefined ? null : ms / 1000;
}

/** An offer refused outright (the worker closing): its blocks go back as after a failed push. */
function failedOffer(): { reason: 'failed' } {
  return { reason: 'failed' };
}

/** The set under key, made when missing. */
function getOrAdd<T>(m: Map<string, Set<T>>, key: string): Set<T> {
  let v = m.get(key);
  if (!v) {
    v = new Set();
    m.set(key, v);
  }
  return v;
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(t);
      resolve();
    });
  });
}
