// A worker's metrics listener (--metrics-port, startWorker({ metricsPort })):
// GET /metrics and GET /health on an HTTP port of their own, for a worker of
// either transport. A ZeroMQ worker has no HTTP front, so this is where
// Prometheus scrapes it (as Dynamo's system port serves a worker's /metrics
// and /health beside its request plane); an HTTP worker keeps /metrics on its
// API port too, where vLLM serves it. Same limits (http-server.ts) and the
// same 404 / 405 answers (routes.ts) as the API fronts.
import type * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { FrontHandler } from './front';
import { createLimitedServer } from '../../api/http-server';
import { errorBody } from '../../api/openai';
import { type RouteTable, routeMiss } from '../../api/routes';

/** What the metrics listener serves: nothing else, and nothing that takes a body. */
export const METRICS_ROUTES: RouteTable = new Map([
  ['/metrics', { methods: ['GET'] }],
  ['/health', { methods: ['GET'] }],
]);

type Json = (status: number, body: unknown, more?: Record<string, string | number>) => void;

/** A worker's /health answer: 200 ok, or 503 with the reason, and what healthInfo says. */
export function healthAnswer(w: FrontHandler): { status: number; body: Record<string, unknown> } {
  const sick = w.unhealthy();
  return {
    status: sick ? 503 : 200,
    body: { status: sick ? 'unavailable' : 'ok', ...(sick ? { reason: sick } : {}), ...w.healthInfo() },
  };
}

/** GET /metrics: vLLM's series and nixl-node's (vllm-metrics.ts); 501 naming the package without prom-client. */
export async function sendMetrics(w: FrontHandler, res: http.ServerResponse, json: Json): Promise<void> {
  const m = await w.metrics?.scrape();
  if (!m) return json(501, errorBody('/metrics needs prom-client: npm install prom-client@15', 'not_implemented'));
  res.writeHead(200, { 'content-type': m.contentType });
  res.end(m.text);
}

/** A JSON answer on `res` (nothing when an answer already started). */
export function jsonAnswer(res: http.ServerResponse): Json {
  return (status, body, more = {}) => {
    if (res.headersSent) return void res.end();
    const text = JSON.stringify(body);
    res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), ...more });
    res.end(text);
  };
}

export interface MetricsPortOptions {
  /** Its port (0: any free port); undefined: no listener. */
  metricsPort?: number;
  /** A request not all arrived by then is cut (408; default 30 s). */
  requestTimeoutMs?: number;
}

/** The listener; `url` is its base (http://host:port). */
export class MetricsPort {
  private constructor(
    readonly server: http.Server,
    readonly url: string,
  ) {}

  /** Listens on host:metricsPort (undefined when no port is asked for); rejects (EADDRINUSE...) when it cannot. */
  static async open(w: FrontHandler, host: string, o: MetricsPortOptions): Promise<MetricsPort | undefined> {
    if (o.metricsPort === undefined) return undefined;
    const server = createLimitedServer(
      { requestTimeoutMs: o.requestTimeoutMs ?? 30_000 },
      (req, res) => void onRequest(w, req, res),
    );
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(o.metricsPort, host, () => resolve());
    });
    const { port } = server.address() as AddressInfo;
    return new MetricsPort(server, `http://${host.includes(':') ? `[${host}]` : host}:${port}`);
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise((r) => this.server.close(r));
  }
}

async function onRequest(w: FrontHandler, req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
  const json = jsonAnswer(res);
  const path = (req.url ?? '').split('?')[0];
  const miss = routeMiss(METRICS_ROUTES, req.method, path);
  if (miss) return json(miss.status, miss.body, miss.headers);
  // A scrape or probe sends no body; one that does is not read, and the connection is not kept.
  if (req.headers['content-length'] !== undefined || req.headers['transfer-encoding'] !== undefined)
    res.shouldKeepAlive = false;
  if (path === '/health') {
    const h = healthAnswer(w);
    return json(h.status, h.body);
  }
  try {
    await sendMetrics(w, res, json);
  } catch (e) {
    json(500, errorBody(`metrics: ${(e as Error)?.message ?? e}`, 'internal_error'));
  }
}
