// The proxy's front: what its route handlers take (ProxyCall), and its
// answers about itself, from its pools: GET /health (its workers, 503 while
// a stage has none healthy or the prefill and decode pools serve different
// models) and GET /v1/models (what the healthy decode workers serve, as
// their health answers said).
import type * as http from 'node:http';
import { modelMismatch, namesOf, servedModels } from './pairing';
import type { Stage, WorkerPool } from './pool';

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
