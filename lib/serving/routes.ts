// Which method each path of the proxy and of a worker serves, and the one
// answer both give otherwise: 404 for a path neither serves, 405 with
// `Allow` for a known path asked with another method (as HTTP says).
import { GENERATE_PATH } from './generate';
import { errorBody } from './openai';

/** Path -> the methods it serves. */
export type RouteTable = ReadonlyMap<string, readonly string[]>;

const POST = ['POST'] as const;
const GET = ['GET'] as const;
const API: Array<[string, readonly string[]]> = [
  ['/v1/completions', POST],
  ['/v1/chat/completions', POST],
  [GENERATE_PATH, POST],
  ['/v1/models', GET],
  ['/health', GET],
  ['/metrics', GET],
];

/** The API's POST routes: what the proxy sends on to workers. */
export const API_ROUTES: ReadonlySet<string> = new Set(API.filter(([, m]) => m === POST).map(([p]) => p));
/** A worker's routes: the API, Prometheus' /metrics, the proxy's KV release, and vLLM's (de)tokenize for routers. */
export const WORKER_ROUTES: RouteTable = new Map([
  ...API,
  ['/v1/kv/release', POST],
  ['/tokenize', POST],
  ['/detokenize', POST],
]);
/** The proxy's routes: the API and Prometheus' /metrics. */
export const PROXY_ROUTES: RouteTable = new Map(API);

/** What to answer instead of serving, or undefined when `method` serves `path`. */
export function routeMiss(
  routes: RouteTable,
  method: string | undefined,
  path: string,
): { status: number; body: Record<string, unknown>; headers: Record<string, string> } | undefined {
  const allowed = routes.get(path);
  const shown = JSON.stringify(path.slice(0, 100));
  if (!allowed)
    return { status: 404, body: errorBody(`no route ${shown}`, 'not_found', { code: 'not_found' }), headers: {} };
  if (allowed.includes(method ?? '')) return undefined;
  return {
    status: 405,
    body: errorBody(
      `${String(method).slice(0, 20)} is not allowed on ${path}: use ${allowed.join(', ')}`,
      'invalid_request_error',
      {
        code: 'method_not_allowed',
      },
    ),
    headers: { allow: allowed.join(', ') },
  };
}
