// The proxy's HTTP front: its routes (GET /health, /v1/models and /metrics,
// the API's POST routes), bearer auth, reading and checking a request's body,
// its span and log line, mapping a failed request to its answer, and the SSE
// relay of a streamed one. GET /health says what its workers are (503 while a
// stage has none healthy or the prefill and decode pools serve different
// models); GET /v1/models what the healthy decode workers serve, as their
// health answers said.
import { randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import { contextFromTraceparent, startSpan } from '../../tracing';
import { retryAfterHeader } from '../api/errors';
import { GENERATE_PATH } from '../api/generate';
import { HttpError, readJson } from '../api/http';
import { ModelNotFound, errorBody, modelNotFoundBody, withClientId } from '../api/openai';
import { checkRequestBody } from '../api/request-checks';
import { API_ROUTES, PROXY_ROUTES, Router } from '../api/routes';
import type { RoutingOptions } from '../fleet/routing';
import { type PreciseRouting, prefillKey } from '../kv-index/precise';
import { routedPrompt } from '../kv-index/tokenizer';
import type { Logger } from '../log';
import { takeConversationId } from './conversations';
import type { Dispatch } from './dispatch';
import type { ProxyMetrics, ProxyStats } from './metrics';
import { modelMismatch, namesOf, servedModels, serves } from './pairing';
import type { Stage, WorkerPool } from './pool';
import { type ProxyRequest, StageFailure, type StageResult } from './stage-call';

type Pools = Readonly<Record<Stage, WorkerPool>>;

/** One request as the proxy's route handlers take it. */
export interface ProxyCall {
  req: http.IncomingMessage;
  res: http.ServerResponse;
  path: string;
  /** Answers JSON (and counts the answer by route and status). */
  send(status: number, body: unknown, headers?: Record<string, string>): void;
  /** The proxy's own id, sent to the workers. */
  requestId: string;
  /** The client's X-Request-Id when usable, else requestId: given back. */
  label: string;
}

export function proxyHealth(pools: Pools): { status: number; body: Record<string, unknown> } {
  const healthy = (s: Stage) => pools[s].workers.filter((w) => w.healthy).length;
  const mismatch = modelMismatch(pools.prefill, pools.decode);
  const ok =
    healthy('prefill') > 0 &&
    healthy('decode') > 0 &&
    (pools.encode.size === 0 || healthy('encode') > 0) &&
    mismatch === undefined;
  return {
    status: ok ? 200 : 503,
    body: {
      status: ok ? 'ok' : 'degraded',
      ...(mismatch ? { error: mismatch } : {}),
      workers: Object.fromEntries(
        Object.entries(pools).map(([s, p]) => [
          s,
          p.workers.map((w) => ({
            address: w.address,
            healthy: w.healthy,
            outstanding: w.outstanding,
            ...(w.model ? { model: w.model } : {}),
          })),
        ]),
      ),
    },
  };
}

export function proxyModels(pools: Pools): Record<string, unknown> {
  const data = servedModels(pools.decode).map((id) => {
    const len = pools.decode.workers.find((w) => namesOf(w).includes(id) && w.maxModelLen)?.maxModelLen;
    return { id, object: 'model', owned_by: 'nixl-node', ...(len ? { max_model_len: len } : {}) };
  });
  return { object: 'list', data };
}

/** What the front needs of the proxy. */
export interface FrontDeps {
  pools: Pools;
  dispatch: Dispatch;
  stats: ProxyStats;
  log: Logger;
  prom?: ProxyMetrics;
  kvRouting?: PreciseRouting;
  /** Requires `Authorization: Bearer <token>` on the API routes. */
  bearerToken?: string;
  /** Largest request body, bytes (default 1 MiB). */
  maxBodyBytes?: number;
  routing?: RoutingOptions;
}

const REQUEST_ID = /^[\x21-\x7e]{1,128}$/;

/** One API request as the front serves it: its ids, its answer's status so far, and why it failed. */
interface Served {
  call: ProxyCall;
  body: Record<string, unknown>;
  status: number;
  failure?: string;
}

export class ProxyFront {
  readonly #d: FrontDeps;
  /** Each request's controller, aborted when the proxy closes. */
  readonly #inflight = new Set<AbortController>();
  readonly #router: Router<(c: ProxyCall) => unknown>;

  constructor(d: FrontDeps) {
    this.#d = d;
    this.#router = new Router<(c: ProxyCall) => unknown>(PROXY_ROUTES, {
      '/health': ({ send }) => {
        const h = proxyHealth(d.pools);
        send(h.status, h.body);
      },
      '/v1/models': ({ send }) => send(200, proxyModels(d.pools)),
      '/metrics': (c) => this.#metrics(c),
      '/v1/completions': (c) => this.#api(c),
      '/v1/chat/completions': (c) => this.#api(c),
      [GENERATE_PATH]: (c) => this.#api(c),
    });
  }

  async onRequest(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
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
      this.#d.prom?.requests.inc({ route: API_ROUTES.has(path) ? path : 'other', status: String(status) });
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

  /** Aborts every request in flight (the proxy is closing). */
  abortAll(reason: Error): void {
    for (const ac of this.#inflight) ac.abort(reason);
  }

  async #metrics({ res, send }: ProxyCall): Promise<void> {
    const prom = this.#d.prom;
    if (!prom) return send(501, errorBody('install prom-client for /metrics', 'not_implemented'));
    const text = await prom.registry.metrics();
    res.writeHead(200, { 'content-type': prom.registry.contentType });
    res.end(text);
  }

  /** The API's POST routes: the client's request through the stages. */
  async #api(c: ProxyCall): Promise<void> {
    const { bearerToken } = this.#d;
    if (bearerToken !== undefined && c.req.headers.authorization !== `Bearer ${bearerToken}`)
      return c.send(401, errorBody('missing or wrong bearer token', 'authentication_error'), {
        'www-authenticate': 'Bearer',
      });
    const read = await this.#read(c);
    if (read) await this.#serve(c, read.body, read.conversation);
  }

  /** The request's body, read and checked; undefined when it was answered (an error) instead. */
  async #read(c: ProxyCall): Promise<{ body: Record<string, unknown>; conversation?: string } | undefined> {
    try {
      const body = await readJson(c.req, this.#d.maxBodyBytes ?? 1 << 20);
      const conversation = takeConversationId(body);
      checkRequestBody(PROXY_ROUTES, c.path, body, 'proxy');
      checkModel(this.#d.pools, body);
      return { body, conversation };
    } catch (e) {
      if (e instanceof ModelNotFound) return void c.send(404, modelNotFoundBody(e));
      const h = e as HttpError;
      c.send(
        h.status ?? 400,
        errorBody(h.message, 'invalid_request_error', h.details),
        h.status === 413 ? { connection: 'close' } : {},
      );
    }
  }

  /** The request through the stages, under its span, answered and logged whatever happens. */
  async #serve(call: ProxyCall, body: Record<string, unknown>, conversation?: string): Promise<void> {
    const { req, res, path, requestId, label } = call;
    const { stats, prom, pools } = this.#d;
    stats.requests++;
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
    prom?.timeAnswer(path, res);
    const prompted = routedPrompt(path, body);
    const affinity = await prefillKey(pools.prefill.policy, prompted, this.#d.routing, this.#d.kvRouting);
    const s: Served = { call, body, status: 200 };
    const t0 = performance.now();
    const ac = new AbortController();
    this.#inflight.add(ac);
    prom?.inflight.inc();
    // The client went away before the answer ended: abort whatever stage is in flight.
    res.on('close', () => {
      if (!res.writableFinished) ac.abort(new Error('client disconnected'));
    });
    const r: ProxyRequest = { path, body, requestId, signal: ac.signal, trace: span.context, affinity, conversation };
    try {
      await this.#answer(s, r, await this.#d.dispatch.run(r));
      stats.completed++;
    } catch (e) {
      span.fail(e);
      if (ac.signal.aborted) {
        stats.aborted++;
        span.setAttribute('nixl_node.aborted', true);
        res.destroy();
      } else this.#failed(s, e);
    } finally {
      this.#inflight.delete(ac);
      prom?.inflight.dec();
      span.setAttribute('http.response.status_code', s.status);
      span.end();
      this.#logLine(s, ac.signal.aborted, t0);
    }
  }

  /** The decode's answer to the client: whole, or relayed as SSE. */
  async #answer(s: Served, r: ProxyRequest, dec: StageResult): Promise<void> {
    const { res, path, requestId, label } = s.call;
    const clientId = label !== requestId ? label : undefined;
    const a = dec.answer;
    if (!a.chunks) {
      s.status = a.status;
      s.call.send(a.status, withClientId(a.json, clientId));
      return;
    }
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' });
    try {
      for await (const c of a.chunks) res.write(`data: ${JSON.stringify(withClientId(c, clientId))}\n\n`);
    } catch (e) {
      if (r.signal.aborted) throw e;
      // Mid-stream: the status line is gone; say so in the stream, then end it.
      const why = `decode worker ${dec.worker.address} failed mid-stream: ${(e as Error).message}`;
      const err = errorBody(why, 'stage_failed', { stage: 'decode', worker: dec.worker.address });
      res.write(`data: ${JSON.stringify(err)}\n\n`);
    } finally {
      dec.release();
    }
    res.end('data: [DONE]\n\n');
    this.#d.prom?.requests.inc({ route: path, status: '200' });
  }

  /** A request that failed before its answer: its status and error from the stage that failed. */
  #failed(s: Served, e: unknown): void {
    this.#d.stats.failed++;
    const f =
      e instanceof StageFailure ? e : new StageFailure(502, 'decode', undefined, (e as Error)?.message ?? String(e));
    s.failure = f.message;
    s.status = f.status;
    const details = {
      stage: f.stage,
      worker: f.worker ?? null,
      request_id: s.call.label,
      ...(f.type ? { code: f.type } : {}),
    };
    s.call.send(f.status, errorBody(f.message, 'stage_failed', details), retryAfterHeader(f.type));
  }

  #logLine(s: Served, aborted: boolean, t0: number): void {
    const fields = {
      req_id: s.call.label,
      request_id: s.call.requestId,
      route: s.call.path,
      model: s.body.model,
      stream: s.body.stream === true,
      status: aborted ? 499 : s.status,
      ms: Math.round(performance.now() - t0),
      ...(s.failure ? { error: s.failure } : {}),
    };
    if (s.failure) this.#d.log.warn(fields, 'request failed');
    else this.#d.log.info(fields, aborted ? 'request aborted' : 'request');
  }
}

/**
 * Before any work: a 404 for a model no healthy decode worker serves (as
 * vLLM answers), and a 400 for a max_tokens that leaves no room for a
 * prompt in the context of every worker that serves the model.
 */
function checkModel(pools: Pools, body: Record<string, unknown>): void {
  const model = typeof body.model === 'string' ? body.model : undefined;
  const all = pools.decode.workers;
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
