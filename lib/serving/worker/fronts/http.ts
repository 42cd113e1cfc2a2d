// A worker's HTTP front: OpenAI-compatible /v1/completions and
// /v1/chat/completions (JSON or SSE), /v1/models, /health, and
// /v1/kv/release for the proxy.
import { randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { retryAfterHeader } from '../../api/errors';
import type { FrontHandler } from './front';
import { GENERATE_PATH } from '../../api/generate';
import { serveRoute } from './generate-route';
import { HttpError, readJson } from '../../api/http';
import { createLimitedServer } from '../../api/http-server';
import { ModelNotFound, errorBody, modelList, modelNotFoundBody } from '../../api/openai';
import { healthAnswer, sendMetrics } from './metrics-port';
import { checkRequestBody } from '../../api/request-checks';
import { Router, WORKER_ROUTES } from '../../api/routes';
import { detokenizeBody, tokenizeBody } from '../tokenize';

export interface HttpFrontOptions {
  host: string;
  port: number;
  maxBodyBytes: number;
  /** A request whose headers and body have not all arrived by then is cut. */
  requestTimeoutMs: number;
}

/** Listens; resolves with the server and its base URL. */
export async function serveHttp(w: FrontHandler, o: HttpFrontOptions): Promise<{ server: http.Server; url: string }> {
  const server = createLimitedServer(o, (req, res) => void onRequest(w, o, req, res));
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(o.port, o.host, () => resolve());
  });
  return { server, url: `http://${o.host}:${(server.address() as AddressInfo).port}` };
}

/** One request as the worker's route handlers take it. */
interface Call {
  w: FrontHandler;
  o: HttpFrontOptions;
  req: http.IncomingMessage;
  res: http.ServerResponse;
  path: string;
  json(status: number, body: unknown, more?: Record<string, string | number>): void;
}

const router = new Router<(c: Call) => unknown>(WORKER_ROUTES, {
  '/health': ({ w, json }) => {
    const h = healthAnswer(w);
    json(h.status, h.body);
  },
  '/v1/models': ({ w, json }) => json(200, modelList(w.servedModelNames ?? [w.modelId])),
  '/metrics': ({ w, res, json }) => sendMetrics(w, res, json),
  '/v1/kv/release': release,
  '/tokenize': tokenize,
  '/detokenize': tokenize,
  '/v1/completions': api,
  '/v1/chat/completions': api,
  [GENERATE_PATH]: api,
});

async function onRequest(
  w: FrontHandler,
  o: HttpFrontOptions,
  req: http.IncomingMessage,
  res: http.ServerResponse,
): Promise<void> {
  const json = (status: number, body: unknown, more: Record<string, string | number> = {}) => {
    if (res.headersSent) return void res.end();
    const text = JSON.stringify(body);
    res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), ...more });
    res.end(text);
  };
  const path = (req.url ?? '').split('?')[0];
  const found = router.find(req.method, path);
  if ('miss' in found) return json(found.miss.status, found.miss.body, found.miss.headers);
  await found.handler({ w, o, req, res, path, json });
}

/** POST /v1/kv/release: the proxy frees a prefill's hold. */
async function release({ w, req, path, json }: Call): Promise<void> {
  try {
    const b = await readJson(req, 4096);
    checkRequestBody(WORKER_ROUTES, path, b, 'worker');
    if (b.remote_request_id === undefined && b.request_id !== undefined)
      return json(200, { released: w.releaseRequest(b.request_id) > 0 });
    return json(200, { released: w.releaseHold(b.remote_request_id) });
  } catch (e) {
    const h = e instanceof HttpError ? e : new HttpError(400, (e as Error).message);
    return json(h.status, errorBody(h.message, h.code, h.details));
  }
}

/** POST /tokenize and /detokenize: vLLM's, for a router that computes block keys (tokenize.ts). */
async function tokenize({ w, o, req, path, json }: Call): Promise<void> {
  try {
    const b = await readJson(req, o.maxBodyBytes);
    checkRequestBody(WORKER_ROUTES, path, b, 'worker');
    return json(200, path === '/tokenize' ? tokenizeBody(w, b) : detokenizeBody(w, b));
  } catch (e) {
    const h = e instanceof HttpError ? e : new HttpError(400, (e as Error).message);
    return json(h.status, h instanceof ModelNotFound ? modelNotFoundBody(h) : errorBody(h.message, h.code, h.details));
  }
}

/** The API's POST routes: the request through the worker, JSON or SSE. */
async function api({ w, o, req, res, path, json }: Call): Promise<void> {
  const ac = new AbortController();
  res.on('close', () => {
    if (!res.writableFinished) ac.abort();
  });
  try {
    const body = await readJson(req, o.maxBodyBytes);
    const header = req.headers['x-request-id'];
    // generate: ids are built from the header, else the body's request_id (as vLLM does).
    const rid = path === GENERATE_PATH && typeof header !== 'string' ? '' : String(header ?? randomUUID());
    let streaming = false;
    await serveRoute(w, {
      path,
      body,
      requestId: rid,
      signal: ac.signal,
      sink: {
        chunk: (c) => {
          if (!streaming) {
            streaming = true;
            res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
          }
          res.write(`data: ${JSON.stringify(c)}\n\n`);
        },
        end: (status, b) => {
          if (streaming) res.end('data: [DONE]\n\n');
          else json(status, b);
        },
      },
      traceparent: req.headers.traceparent,
      hints: { decodeMaxTokens: req.headers['x-nixl-node-decode-max-tokens'] },
    });
  } catch (e) {
    const h = w.failed(e);
    json(
      h.status,
      h instanceof ModelNotFound ? modelNotFoundBody(h) : errorBody(h.message, h.code, h.details),
      // A body past the limit is not read to its end: the connection goes, as the proxy's front does.
      { ...retryAfterHeader(h.code), ...(h.status === 413 ? { connection: 'close' } : {}) },
    );
  }
}
