// The route table bound to a front's handlers (lib/serving/api/routes.ts): every
// route has a handler and every handler a route, checked as the front is
// built; a request finds its handler or the 404/405 both fronts answer.
import { describe, expect, it } from 'vitest';
import { PROXY_ROUTES, Router, WORKER_ROUTES } from '../../lib/serving/api/routes';

const all = (table: typeof WORKER_ROUTES) => Object.fromEntries([...table.keys()].map((p) => [p, p]));

describe('Router', () => {
  it('refuses a table with a route nobody handles, or a handler for a route it lacks', () => {
    const { '/v1/kv/release': _, ...noRelease } = all(WORKER_ROUTES);
    expect(() => new Router(WORKER_ROUTES, noRelease)).toThrow(/no handler for the route \/v1\/kv\/release/);
    expect(() => new Router(PROXY_ROUTES, { ...all(PROXY_ROUTES), '/v1/kv/release': 'x' })).toThrow(
      /not in the routes/,
    );
  });

  it("finds the path's handler and body schema, else the 404 or 405 (with Allow)", () => {
    const r = new Router(WORKER_ROUTES, all(WORKER_ROUTES));
    expect(r.find('POST', '/v1/kv/release')).toMatchObject({
      handler: '/v1/kv/release',
      route: { body: 'kv-release-request' },
    });
    expect(r.find('GET', '/health')).toMatchObject({ handler: '/health', route: { methods: ['GET'] } });
    expect(r.find('GET', '/nope')).toMatchObject({ miss: { status: 404 } });
    expect(r.find('GET', '/v1/completions')).toMatchObject({ miss: { status: 405, headers: { allow: 'POST' } } });
    // An inherited name is not a route.
    expect(r.find('GET', '/constructor')).toMatchObject({ miss: { status: 404 } });
  });
});
