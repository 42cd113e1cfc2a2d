// The routes of the proxy and of a worker, in one table each: the methods a
// path serves and the JSON Schema its body is checked against (docs/, read
// by body-schemas.ts; request-checks.ts checks it). Both fronts answer the
// same otherwise: 404 for a path neither serves, 405 with `Allow` for a
// known path asked with another method (as HTTP says).
import type { BodySchemaName } from './body-schemas';
import { GENERATE_PATH } from './generate';
import { errorBody } from './openai';

export interface Route {
  readonly methods: readonly string[];
  /** The body's schema, docs/<body>.schema.json; none: the route takes no body. */
  readonly body?: BodySchemaName;
}

/** Path -> what it serves. */
export type RouteTable = ReadonlyMap<string, Route>;

const POST = ['POST'] as const;
const GET = { methods: ['GET'] } as const;
const API: Array<[string, Route]> = [
  ['/v1/completions', { methods: POST, body: 'completions-request' }],
  ['/v1/chat/completions', { methods: POST, body: 'chat-completions-request' }],
  [GENERATE_PATH, { methods: POST, body: 'generate-request' }],
  ['/v1/models', GET],
  ['/health', GET],
  ['/metrics', GET],
];

/** The API's POST routes: what the proxy sends on to workers. */
export const API_ROUTES: ReadonlySet<string> = new Set(API.filter(([, r]) => r.methods === POST).map(([p]) => p));
/** A worker's routes: the API, Prometheus' /metrics, the proxy's KV release, and vLLM's (de)tokenize for routers. */
export const WORKER_ROUTES: RouteTable = new Map([
  ...API,
  ['/v1/kv/release', { methods: POST, body: 'kv-release-request' }],
  ['/tokenize', { methods: POST, body: 'tokenize-request' }],
  ['/detokenize', { methods: POST, body: 'detokenize-request' }],
]);
/** The proxy's routes: the API and Prometheus' /metrics. */
export const PROXY_ROUTES: RouteTable = new Map(API);

/** What to answer instead of serving, or undefined when `method` serves `path`. */
export function routeMiss(
  routes: RouteTable,
  method: string | undefined,
  path: string,
): { status: number; body: Record<string, unknown>; headers: Record<string, string> } | undefined {
  const allowed = routes.get(path)?.methods;
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

/** What a front answers a request with when its route table has no handler for it: 404 or 405. */
export type RouteMiss = NonNullable<ReturnType<typeof routeMiss>>;

/**
 * A front's route table bound to its handlers, one per path: the one place
 * a front goes from method and path to what serves it (or the 404/405 both
 * fronts give). Built as the front starts: a path with no handler, or a
 * handler for a path the table lacks, fails there, not on a request.
 */
export class Router<H> {
  readonly #handlers: ReadonlyMap<string, H>;

  constructor(
    readonly routes: RouteTable,
    handlers: Readonly<Record<string, H>>,
  ) {
    for (const p of routes.keys()) if (!Object.hasOwn(handlers, p)) throw new Error(`no handler for the route ${p}`);
    for (const p of Object.keys(handlers)) if (!routes.has(p)) throw new Error(`a handler for ${p}, not in the routes`);
    this.#handlers = new Map(Object.entries(handlers));
  }

  /** The handler that serves `method` on `path`, or the answer instead. */
  find(method: string | undefined, path: string): { handler: H; route: Route } | { miss: RouteMiss } {
    const miss = routeMiss(this.routes, method, path);
    if (miss) return { miss };
    return { handler: this.#handlers.get(path)!, route: this.routes.get(path)! };
  }
}
