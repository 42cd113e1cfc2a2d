// The disaggregated-serving proxy: an OpenAI-compatible HTTP front that sends
// each request through an encoder (when configured and the request has
// images), then a prefill worker (kv_transfer_params {do_remote_decode: true},
// max_tokens 1), then a decode worker with the kv_transfer_params the prefill
// returned, and passes the decode's answer back, streamed (SSE) or not.
import { randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { WireName } from '../../handshake/model';
import { parseKvTransferParams, prefillRequestParams, wireProfile } from '../../handshake/wire';
import { type ConversationOptions, Conversations, carryTurn, takeConversationId } from './conversations';
import { namesPreviousTurn } from '../../kv/turn-params';
import { type Policy, type Stage, type WorkerRef, WorkerPool } from './pool';
import { HttpTransport, type StageAnswer, type TransportError, type WorkerTransport, ZmqTransport } from './transports';
import { type SpanLike, type TraceContext, contextFromTraceparent, startSpan } from '../../tracing';
import { checkRequestBody, compileBodySchemas } from '../api/request-checks';
import { API_ROUTES, PROXY_ROUTES, Router } from '../api/routes';
import { type ProxyCall, proxyHealth, proxyModels } from './front';
import { GENERATE_PATH, generateDecodeBody, generatePrefillBody } from '../api/generate';
import { HttpError, hasImages, readJson } from '../api/http';
import { createLimitedServer } from '../api/http-server';
import { ModelNotFound, errorBody, modelNotFoundBody, withClientId } from '../api/openai';
import { ProxyMetrics } from './metrics';
import { NixlError } from '../../errors';
import { checkWorkerAddress } from './addresses';
import { StageTimeout } from './stage-signal';
import { type Logger, silentLogger } from '../log';
import { hasDecodeFor, modelMismatch, namesOf, sameModel, serves } from './pairing';
import { FleetDiscovery, type FleetWatchOptions } from '../fleet/discovery';
import type { RoutingOptions } from '../fleet/routing';
import { newTransferId, pushPrefillAndDecode, pushPrefillParams } from './push-proxy';
import { KV_BUSY_CODES, retryAfter } from '../worker/blocks';
import { type KvEventsOptions, PreciseRouting, preciseFor, prefillKey } from '../kv-index/precise';

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

const REQUEST_ID = /^[\x21-\x7e]{1,128}$/;

class StageFailure extends Error {
  constructor(
    readonly status: number,
    readonly stage: Stage,
    readonly worker: string | undefined,
    message: string,
    /** The worker's error type, when it answered one (kv_expired: prefill again). */
    readonly type?: string,
  ) {
    super(message);
  }

  /** What a span records as the error code: the worker's code, else the stage and status. */
  get code(): string {
    return this.type ?? `stage_failed_${this.status}`;
  }
}

/**
 * The disaggregated-serving front door: an OpenAI-compatible server that
 * sends each request through encode, prefill and decode workers.
 */
export class ServingProxy {
  readonly pools: Record<Stage, WorkerPool>;
  readonly stats = {
    requests: 0,
    completed: 0,
    failed: 0,
    aborted: 0,
    retries: 0,
    /** Requests prefilled again because their decode's pull expired, or their decode failed. */
    expiredRetries: 0,
    decodeRetries: 0,
    /** Prefill holds freed early (decode failed or client gone), instead of at lease end. */
    holdsReleased: 0,
  };
  url = '';
  readonly #o: ProxyOptions;
  /** conversation_id -> the params of its last turn's KV, held by the decode that answered it. */
  readonly conversations: Conversations;
  readonly #transport: WorkerTransport;
  readonly #server: http.Server;
  readonly #inflight = new Set<AbortController>();
  /** Each request's span context, by our request id: its stages' spans are its children. */
  readonly #traces = new Map<string, TraceContext>();
  #health?: NodeJS.Timeout;
  readonly #log: Logger;
  /** The last model mismatch logged (logged again only when it changes). */
  #mismatch?: string;
  /** The workers etcd lists, when given `etcd`. */
  fleet?: FleetDiscovery;
  /** Each prefill's prefix-affinity key, by our request id ('load' policy). */
  readonly #affinity = new Map<string, string | object>();
  /**
   * The prefills' KV events and the 'precise' policy, when asked for.
   * @internal
   */
  kvRouting?: PreciseRouting;
  readonly #prom = ProxyMetrics.create();
  /** The X-Request-Id a client sent, by our request id: its answer's id is made of it. */
  readonly #clientIds = new Map<string, string>();

  constructor(o: ProxyOptions) {
    this.#o = o;
    this.conversations = new Conversations(o.conversations);
    if (!o.etcd && (!o.prefill?.length || !o.decode?.length))
      throw new NixlError('a proxy needs prefill and decode workers (or etcd to find them)', 'NIXL_ERR_INVALID_PARAM');
    wireProfile(o.wire);
    this.#log = o.logger ?? silentLogger;
    const policy = o.policy ?? 'round-robin';
    const kind = o.transport ?? 'http';
    const checked = (role: Stage, list: string[] = []) => list.map((a) => checkWorkerAddress(a, kind, role));
    this.pools = {
      encode: new WorkerPool('encode', checked('encode', o.encode), policy, o.routing),
      prefill: new WorkerPool('prefill', checked('prefill', o.prefill), policy, o.routing),
      decode: new WorkerPool('decode', checked('decode', o.decode), policy, o.routing),
    };
    this.#transport = kind === 'zmq' ? new ZmqTransport() : new HttpTransport();
    this.#server = createLimitedServer(
      { requestTimeoutMs: o.requestTimeoutMs ?? 30_000, maxConnections: o.maxConnections },
      (req, res) => void this.#onRequest(req, res),
    );
    this.kvRouting = preciseFor(policy, this.pools.prefill, o.kvEvents, this.#prom?.registry, this.#log);
    if (o.etcd) this.fleet = new FleetDiscovery(this.pools, kind, o.etcd, this.#prom?.registry, this.#log);
  }

  /** Listens; resolves once the proxy takes requests. */
  async start(): Promise<this> {
    if (this.#transport instanceof ZmqTransport) await this.#transport.bind(this.#o.zmqReplyAddr);
    const host = this.#o.host ?? '127.0.0.1';
    await new Promise<void>((resolve, reject) => {
      this.#server.once('error', reject);
      this.#server.listen(this.#o.port ?? 0, host, () => resolve());
    });
    this.url = `http://${host.includes(':') ? `[${host}]` : host}:${(this.#server.address() as AddressInfo).port}`;
    await this.fleet?.start();
    this.kvRouting?.start();
    const every = this.#o.healthIntervalMs ?? 2000;
    if (every > 0) {
      // One round first: once start() resolves, /v1/models and /health say what the workers serve.
      await this.checkHealth({ learnOnly: true });
      this.#health = setInterval(() => void this.checkHealth(), every);
      this.#health.unref();
    }
    return this;
  }

  /**
   * One round of health checks over every worker. `learnOnly`: only learn
   * what the workers serve; one slow to answer its first check (a process
   * just started, a ZeroMQ peer still connecting) is not taken out for it.
   */
  async checkHealth(o: { learnOnly?: boolean } = {}): Promise<void> {
    const all = Object.values(this.pools).flatMap((p) => p.workers.map((w) => ({ p, w })));
    await Promise.all(
      all.map(async ({ p, w }) => {
        const { ok, cause } = await this.#transport.healthCheck(w, 1000);
        if (o.learnOnly && !ok) return;
        // Read after the check: rounds may overlap, and only the one that changes the state logs it.
        const was = w.healthy;
        const fields = { stage: w.stage, worker: w.address, model: w.model };
        if (ok) {
          p.markOk(w);
          if (!was) this.#log.info(fields, 'worker healthy again');
        } else {
          p.markFailed(w);
          if (was) this.#log.warn({ ...fields, cause }, 'worker unhealthy: its health check failed');
        }
        this.#prom?.healthy.set({ stage: w.stage, worker: w.address }, ok ? 1 : 0);
      }),
    );
    const mismatch = modelMismatch(this.pools.prefill, this.pools.decode);
    if (mismatch && mismatch !== this.#mismatch) this.#log.error({ reason: 'model_mismatch' }, mismatch);
    else if (!mismatch && this.#mismatch) this.#log.info({}, 'prefill and decode workers serve one model again');
    this.#mismatch = mismatch;
  }

  /** Takes a worker out after a failed request, until a health check passes. */
  #eject(w: WorkerRef, why: string): void {
    if (w.healthy) this.#log.warn({ stage: w.stage, worker: w.address, reason: why }, 'worker ejected');
    this.pools[w.stage].markFailed(w);
  }

  /**
   * Before any work: a 404 for a model no healthy decode worker serves (as
   * vLLM answers), and a 400 for a max_tokens that leaves no room for a
   * prompt in the context of every worker that serves the model.
   */
  #checkModel(body: Record<string, unknown>): void {
    const model = typeof body.model === 'string' ? body.model : undefined;
    const all = this.pools.decode.workers;
    if (model !== undefined && !all.some((w) => serves(w, model)))
      throw new ModelNotFound(model, [...new Set(all.flatMap(namesOf))]);
    const decodes = all.filter((w) => w.healthy && serves(w, model));
    const max = body.max_tokens ?? body.max_completion_tokens;
    if (typeof max !== 'number' || decodes.length === 0 || decodes.some((w) => !w.maxModelLen)) return;
    const len = Math.max(...decodes.map((w) => w.maxModelLen!));
    if (max >= len)
      throw new HttpError(
        400,
        `max_tokens ${max} does not fit: the model's context holds ${len} tokens, the prompt included (max_model_len)`,
      );
  }

  // ---- the front ----------------------------------------------------------

  readonly #router = new Router<(c: ProxyCall) => unknown>(PROXY_ROUTES, {
    '/health': ({ send }) => {
      const h = proxyHealth(this.pools);
      send(h.status, h.body);
    },
    '/v1/models': ({ send }) => send(200, proxyModels(this.pools)),
    '/metrics': (c) => this.#metrics(c),
    '/v1/completions': (c) => this.#api(c),
    '/v1/chat/completions': (c) => this.#api(c),
    [GENERATE_PATH]: (c) => this.#api(c),
  });

  async #onRequest(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const path = (req.url ?? '').split('?')[0];
    // Our own id goes to the workers (unique in flight: prefills free holds
    // by it); the client's is a label, given back as it came in the header
    // and the answer's id (it never reaches a notification, where 'HB:...'
    // or ',' would change what the prefill reads).
    const incoming = req.headers['x-request-id'];
    const requestId = randomUUID();
    const label = typeof incoming === 'string' && REQUEST_ID.test(incoming) ? incoming : requestId;
    res.setHeader('x-request-id', label);
    const send = (status: number, body: unknown, headers: Record<string, string> = {}) => {
      this.#prom?.requests.inc({ route: API_ROUTES.has(path) ? path : 'other', status: String(status) });
      if (res.headersSent) return void res.end();
      const text = JSON.stringify(body);
      res.writeHead(status, {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(text),
        ...headers,
      });
      res.end(text);
    };
    const found = this.#router.find(req.method, path);
    if ('miss' in found) return send(found.miss.status, found.miss.body, found.miss.headers);
    await found.handler({ req, res, path, send, requestId, label });
  }

  async #metrics({ res, send }: ProxyCall): Promise<void> {
    if (!this.#prom) return send(501, errorBody('install prom-client for /metrics', 'not_implemented'));
    const text = await this.#prom.registry.metrics();
    res.writeHead(200, { 'content-type': this.#prom.registry.contentType });
    res.end(text);
  }

  /** The API's POST routes: the client's request through the stages. */
  async #api({ req, res, path, send, requestId, label }: ProxyCall): Promise<void> {
    if (this.#o.bearerToken !== undefined && req.headers.authorization !== `Bearer ${this.#o.bearerToken}`)
      return send(401, errorBody('missing or wrong bearer token', 'authentication_error'), {
        'www-authenticate': 'Bearer',
      });
    let body: Record<string, unknown>;
    let conversation: string | undefined;
    try {
      body = await readJson(req, this.#o.maxBodyBytes ?? 1 << 20);
      conversation = takeConversationId(body);
      checkRequestBody(PROXY_ROUTES, path, body, 'proxy');
      this.#checkModel(body);
    } catch (e) {
      if (e instanceof ModelNotFound) return send(404, modelNotFoundBody(e));
      const h = e as HttpError;
      return send(
        h.status ?? 400,
        errorBody(h.message, 'invalid_request_error', h.details),
        h.status === 413 ? { connection: 'close' } : {},
      );
    }

    this.stats.requests++;
    // One trace per request: the client's traceparent (if any) is its parent.
    const span = startSpan('proxy.request', {
      kind: 'server',
      parent: contextFromTraceparent(req.headers.traceparent),
      attributes: {
        'http.request.method': 'POST',
        'http.route': path,
        'gen_ai.request.model': typeof body.model === 'string' ? body.model : undefined,
        'nixl_node.request_id': label,
      },
    });
    this.#traces.set(requestId, span.context);
    if (label !== requestId) this.#clientIds.set(requestId, label);
    this.#prom?.timeAnswer(path, res);
    const key = await prefillKey(this.pools.prefill.policy, body, this.#o.routing, this.kvRouting);
    if (key !== undefined) this.#affinity.set(requestId, key);
    let status = 200;
    let failure: string | undefined;
    const t0 = performance.now();
    const sendTraced = (s: number, b: unknown, h: Record<string, string> = {}) => {
      status = s;
      send(s, b, h);
    };
    const ac = new AbortController();
    this.#inflight.add(ac);
    this.#prom?.inflight.inc();
    // The client went away before the answer ended: abort whatever stage is in flight.
    res.on('close', () => {
      if (!res.writableFinished) ac.abort(new Error('client disconnected'));
    });
    try {
      await this.#pipeline(path, body, requestId, ac.signal, res, sendTraced, conversation);
      this.stats.completed++;
    } catch (e) {
      span.fail(e);
      if (ac.signal.aborted) {
        this.stats.aborted++;
        span.setAttribute('nixl_node.aborted', true);
        res.destroy();
      } else {
        this.stats.failed++;
        const f =
          e instanceof StageFailure
            ? e
            : new StageFailure(502, 'decode', undefined, (e as Error)?.message ?? String(e));
        failure = f.message;
        sendTraced(
          f.status,
          errorBody(f.message, 'stage_failed', {
            stage: f.stage,
            worker: f.worker ?? null,
            request_id: label,
            ...(f.type ? { code: f.type } : {}),
          }),
          retryAfter(f.type),
        );
      }
    } finally {
      this.#inflight.delete(ac);
      this.#prom?.inflight.dec();
      this.#traces.delete(requestId);
      this.#clientIds.delete(requestId);
      this.#affinity.delete(requestId);
      span.setAttribute('http.response.status_code', status);
      span.end();
      const fields = {
        req_id: label,
        request_id: requestId,
        route: path,
        model: body.model,
        stream: body.stream === true,
        status: ac.signal.aborted ? 499 : status,
        ms: Math.round(performance.now() - t0),
        ...(failure ? { error: failure } : {}),
      };
      if (failure) this.#log.warn(fields, 'request failed');
      else this.#log.info(fields, ac.signal.aborted ? 'request aborted' : 'request');
    }
  }

  async #pipeline(
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    res: http.ServerResponse,
    send: (status: number, body: unknown) => void,
    conversation?: string,
  ): Promise<void> {
    const chat = path === '/v1/chat/completions';
    // The conversation's previous turn, held by its decode: the prefill reads what it can of it.
    const xfer = this.#o.kvMode === 'push' ? newTransferId() : undefined;
    // (vLLM's push has no bidirectional KV: a conversation's turns are prefilled whole.)
    const previous = conversation !== undefined && !xfer ? this.conversations.claim(conversation) : undefined;
    const ask = xfer ? pushPrefillParams(xfer) : (previous?.params ?? prefillRequestParams());
    if (this.pools.encode.size > 0 && hasImages(body)) {
      await this.#stage('encode', path, { ...body, stream: false, max_tokens: 1 }, requestId, signal, false);
    }
    const prefillBody: Record<string, unknown> =
      path === GENERATE_PATH
        ? generatePrefillBody(body, ask)
        : {
            ...body,
            stream: false,
            max_tokens: 1,
            kv_transfer_params: ask,
          };
    if (chat) prefillBody.max_completion_tokens = 1;
    delete prefillBody.stream_options;
    // A decode that could not read the KV inside the prefill's lease answers
    // kv_expired and read nothing it trusts; one that died or broke read
    // nothing we answer from either. Both are safe to run again from a fresh
    // prefill (new blocks), once, on another decode where there is one; then
    // give up with the error (never an answer made from blocks that were
    // reused).
    const avoid = new Set<WorkerRef>();
    let dec: Awaited<ReturnType<ServingProxy['prefillAndDecode']>>;
    try {
      dec = xfer
        ? await pushPrefillAndDecode({
            path,
            body,
            prefillBody,
            requestId,
            signal,
            transferId: xfer,
            pools: this.pools,
            stage: (...a) => this.#stage(...a),
            learn: () => this.checkHealth({ learnOnly: true }),
            release: (w, id) => {
              this.stats.holdsReleased++;
              void this.#transport.release(w, id);
            },
            fail: (status, stage, worker, message, type) => new StageFailure(status, stage, worker, message, type),
          })
        : await this.prefillAndDecode(path, body, prefillBody, requestId, signal, avoid, conversation, previous);
    } catch (e) {
      // Push: never again (the prefill may still WRITE into the first decode's blocks until its lease).
      if (xfer || !(e instanceof StageFailure) || e.stage !== 'decode' || e.status < 500 || signal.aborted) throw e;
      if (e.type === 'kv_expired') this.stats.expiredRetries++;
      else this.stats.decodeRetries++;
      try {
        dec = await this.prefillAndDecode(path, body, prefillBody, requestId, signal, avoid, conversation, previous);
      } catch (again) {
        // Nothing left to try: the first failure says more than 'no healthy worker'.
        throw again instanceof StageFailure && again.worker === undefined ? e : again;
      }
    }
    const a = dec.answer;
    const clientId = this.#clientIds.get(requestId);
    if (!a.chunks) {
      send(a.status, withClientId(a.json, clientId));
      return;
    }
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' });
    try {
      for await (const c of a.chunks) res.write(`data: ${JSON.stringify(withClientId(c, clientId))}\n\n`);
    } catch (e) {
      if (signal.aborted) throw e;
      // Mid-stream: the status line is gone; say so in the stream, then end it.
      res.write(
        `data: ${JSON.stringify(errorBody(`decode worker ${dec.worker.address} failed mid-stream: ${(e as Error).message}`, 'stage_failed', { stage: 'decode', worker: dec.worker.address }))}\n\n`,
      );
    } finally {
      dec.release();
    }
    res.end('data: [DONE]\n\n');
    this.#prom?.requests.inc({ route: path, status: '200' });
  }

  private async prefillAndDecode(
    path: string,
    body: Record<string, unknown>,
    prefillBody: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    avoidDecode: Set<WorkerRef>,
    conversation?: string,
    previous?: { release(): void },
  ): Promise<{ answer: StageAnswer; worker: WorkerRef; release(): void }> {
    const model = typeof body.model === 'string' ? body.model : undefined;
    let pre: { answer: StageAnswer; worker: WorkerRef; release(): void };
    try {
      // No prefill for a decode that cannot take it: its blocks would wait a
      // whole lease for a read that never comes, and fill the prefill's cache.
      if (!this.pools.prefill.anyHealthy)
        throw new StageFailure(503, 'prefill', undefined, 'no healthy prefill worker');
      if (!this.pools.decode.anyHealthy)
        throw new StageFailure(503, 'decode', undefined, 'no healthy decode worker (nothing was prefilled)');
      const mismatch = modelMismatch(this.pools.prefill, this.pools.decode, model);
      if (mismatch)
        throw new StageFailure(503, 'prefill', undefined, `${mismatch} (nothing was prefilled)`, 'model_mismatch');
      const max =
        body.max_tokens ??
        body.max_completion_tokens ??
        (body.sampling_params as Record<string, unknown> | undefined)?.max_tokens;
      pre = await this.#stage(
        'prefill',
        path,
        prefillBody,
        requestId,
        signal,
        false,
        this.#o.prefillRetries ?? 1,
        new Set(),
        {
          // Only a prefill whose KV a healthy decode can load.
          accept: (w) => serves(w, model) && hasDecodeFor(w, this.pools.decode, model),
          decodeMaxTokens: typeof max === 'number' ? max : undefined,
        },
      );
    } catch (e) {
      // This turn failed: nothing will read the previous turn's hold (a read that happened freed it already).
      previous?.release();
      throw e;
    }
    const kv = pre.answer.json?.kv_transfer_params as Record<string, unknown> | undefined;
    let remoteRequestId: string;
    try {
      remoteRequestId = parseKvTransferParams(kv, this.#o.wire).remoteRequestId;
    } catch (e) {
      throw new StageFailure(
        502,
        'prefill',
        pre.worker.address,
        `prefill answered without usable kv_transfer_params: ${(e as Error).message}`,
      );
    }
    const canRelease = (pre.answer.json?.nixl_node as { kv_release?: unknown } | undefined)?.kv_release === true;
    const preInfo = pre.answer.json?.nixl_node as
      | { kv_reused_tokens?: unknown; kv_reuse_skipped?: unknown }
      | undefined;
    const reused = preInfo?.kv_reused_tokens;
    const skipped = typeof preInfo?.kv_reuse_skipped === 'string' ? preInfo.kv_reuse_skipped : undefined;
    // The previous turn's hold, not read (the prompt did not prove to be its prefix...): free it now.
    if (reused === 0) previous?.release();
    const decodeBody = path === GENERATE_PATH ? generateDecodeBody(body, kv!) : { ...body, kv_transfer_params: kv };
    const avoid = new Set([pre.worker, ...avoidDecode]);
    try {
      const dec = await this.#stage('decode', path, decodeBody, requestId, signal, body.stream === true, 0, avoid, {
        accept: (w) => serves(w, model) && sameModel(w.model, pre.worker.model),
      });
      const decodeWorker = dec.worker;
      dec.answer = carryTurn(dec.answer, {
        conversation,
        conversations: this.conversations,
        release: (id) => {
          this.stats.holdsReleased++;
          const t = this.#transport;
          void (id === undefined ? t.releaseRequest(decodeWorker, requestId) : t.release(decodeWorker, id));
        },
        cut: signal,
        reuseSkipped: skipped,
        annotate: PreciseRouting.annotation(this.#affinity.get(requestId)),
        // A miss reused nothing; a prefill that read the previous turn and does not say (vLLM's): not known.
        reusedTokens:
          typeof reused === 'number'
            ? reused
            : conversation !== undefined &&
                !namesPreviousTurn(prefillBody.kv_transfer_params as Record<string, unknown>)
              ? 0
              : undefined,
      });
      return dec;
    } catch (e) {
      // The decode will not read it (failed, or the client went away): the
      // prefill frees the blocks now instead of at the end of its lease.
      if (canRelease) {
        this.stats.holdsReleased++;
        void this.#transport.release(pre.worker, remoteRequestId);
      }
      if (e instanceof StageFailure && e.worker) {
        const w = this.pools.decode.workers.find((x) => x.address === e.worker);
        if (w) avoidDecode.add(w);
      }
      throw e;
    }
  }

  /** One stage on one worker (retried on others for `retries`), with its timeout. */
  async #stage(
    stage: Stage,
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    clientSignal: AbortSignal,
    stream: boolean,
    retries = 0,
    avoid: ReadonlySet<WorkerRef> = new Set(),
    o: { accept?: (w: WorkerRef) => boolean; decodeMaxTokens?: number } = {},
  ): Promise<{ answer: StageAnswer; worker: WorkerRef; release(): void }> {
    const pool = this.pools[stage];
    const tried = new Set<WorkerRef>(avoid);
    let last: StageFailure | undefined;
    for (let attempt = 0; attempt <= retries; attempt++) {
      const w = pool.pick(tried, stage === 'prefill' ? this.#affinity.get(requestId) : undefined, o.accept);
      if (!w || (attempt > 0 && tried.has(w))) break;
      tried.add(w);
      if (attempt > 0) this.stats.retries++;
      const span: SpanLike = startSpan(`proxy.${stage}`, {
        kind: 'client',
        parent: this.#traces.get(requestId),
        attributes: {
          'nixl_node.stage': stage,
          'nixl_node.worker': w.address,
          'nixl_node.attempt': attempt,
          'nixl_node.retry': attempt > 0,
        },
      });
      const timeoutMs = this.#o.timeoutMs?.[stage] ?? 60_000;
      const timeout = new StageTimeout(clientSignal, timeoutMs);
      const t0 = performance.now();
      w.outstanding++;
      let released = false;
      let streaming = false;
      const release = () => {
        if (!released) {
          released = true;
          w.outstanding--;
          if (streaming) timeout.end(span); // a streamed answer's span and timeout last to its end
        }
      };
      const observe = (outcome: string) =>
        this.#prom?.stageSeconds.observe({ stage, outcome }, (performance.now() - t0) / 1000);
      try {
        const answer = await this.#transport.call({
          stage,
          worker: w,
          path,
          body,
          requestId,
          signal: timeout.signal,
          stream,
          traceparent: span.traceparent(),
          decodeMaxTokens: o.decodeMaxTokens,
        });
        observe(String(answer.status));
        span.setAttribute('http.response.status_code', answer.status);
        // An answer, whatever its status, comes from a worker that is up: a
        // refusal of this request (bad KV, a pull that failed, a lease run
        // out) says nothing of the next one. Only an unreachable worker, a
        // timeout or a failed health check takes a worker out.
        if (answer.status >= 400) {
          release();
          const err = answer.json?.error as { message?: string; type?: string; code?: string } | undefined;
          const msg = err?.message ?? `HTTP ${answer.status}`;
          // HTTP workers say it as OpenAI's error type, ZeroMQ ones as code.
          const type = err?.type ?? err?.code;
          // A worker's 4xx is the request's fault: give it to the client as it is. 5xx: retry or 502.
          if (answer.status < 500) {
            const f = new StageFailure(answer.status, stage, w.address, `${stage} worker ${w.address}: ${msg}`, type);
            span.fail(f);
            throw f;
          }
          last = new StageFailure(
            type === 'kv_expired' || KV_BUSY_CODES.has(type ?? '') ? 503 : 502,
            stage,
            w.address,
            `${stage} worker ${w.address} answered ${answer.status}: ${msg}`,
            type,
          );
          span.fail(last);
          continue;
        }
        if (!answer.chunks) release();
        else streaming = true;
        return { answer, worker: w, release };
      } catch (e) {
        release();
        if (e instanceof StageFailure) throw e;
        // A prefill (or a decode, of its turn) may have answered into the connection just
        // cut: its hold's id never arrived, so it is released by our request id instead.
        if (clientSignal.aborted ? stage !== 'encode' : stage === 'prefill' && timeout.aborted) {
          this.stats.holdsReleased++;
          void this.#transport.releaseRequest(w, requestId);
        }
        if (clientSignal.aborted) {
          span.fail(e);
          throw e;
        }
        if (timeout.aborted) {
          observe('timeout');
          // Nothing came back yet, so another worker may take it (a ZeroMQ peer that died says nothing).
          this.#eject(w, `no answer within ${timeoutMs} ms`);
          last = new StageFailure(
            504,
            stage,
            w.address,
            `${stage} worker ${w.address} did not answer within ${timeoutMs} ms`,
          );
          span.fail(last);
          continue;
        }
        observe('unreachable');
        this.#eject(w, `unreachable: ${(e as Error).message}`);
        last = new StageFailure(
          502,
          stage,
          w.address,
          `${stage} worker ${w.address} failed: ${(e as TransportError).message}`,
        );
        span.fail(last);
      } finally {
        if (!streaming) timeout.end(span);
      }
    }
    throw last ?? new StageFailure(503, stage, undefined, `no healthy ${stage} worker`);
  }

  /** Stops: requests in flight are aborted, sockets closed. */
  async close(): Promise<void> {
    clearInterval(this.#health);
    await this.fleet?.close();
    this.kvRouting?.close();
    for (const ac of this.#inflight) ac.abort(new Error('proxy closing'));
    this.#server.closeAllConnections();
    await new Promise((r) => this.#server.close(r));
    await this.#transport.close();
  }
}

/** Starts a serving proxy. */
export async function startProxy(o: ProxyOptions): Promise<ServingProxy> {
  compileBodySchemas(); // at startup, not on the first request (a missing or broken docs/ schema fails here)
  return new ServingProxy(o).start();
}
