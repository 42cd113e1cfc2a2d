// Which prefill and decode workers may serve one request together: a decode
// loads the KV its prefill evaluated, so both must run the same model. Each
// worker's model comes from its health answer (nixl-node workers name it;
// vLLM's /health names none, and such a worker pairs with any).
import type { WorkerPool, WorkerRef } from './pool';

/** Both serve one model, or one of them has not said which. */
export function sameModel(a: string | undefined, b: string | undefined): boolean {
  return a === undefined || b === undefined || a === b;
}

/** Whether a worker serves `model` (a request that names none takes any). */
export function serves(w: WorkerRef, model: string | undefined): boolean {
  return model === undefined || w.model === undefined || namesOf(w).includes(model);
}

/** Every name a worker serves under, as far as the proxy knows (none when it does not know its model). */
export function namesOf(w: WorkerRef): readonly string[] {
  return w.models ?? (w.model === undefined ? [] : [w.model]);
}

/** A healthy decode worker pairs with this prefill (and serves `model`). */
export function hasDecodeFor(pre: WorkerRef, decode: WorkerPool, model?: string): boolean {
  return decode.workers.some((d) => d.healthy && serves(d, model) && sameModel(pre.model, d.model));
}

/** The models the healthy decode workers say they serve. */
export function servedModels(decode: WorkerPool): string[] {
  return [...new Set(decode.workers.filter((w) => w.healthy).flatMap(namesOf))];
}

/**
 * When healthy prefill and decode workers exist but no prefill has a decode
 * of its model: a message naming each side's models. Undefined otherwise.
 */
export function modelMismatch(prefill: WorkerPool, decode: WorkerPool, model?: string): string | undefined {
  const pre = prefill.workers.filter((w) => w.healthy && serves(w, model));
  const dec = decode.workers.filter((w) => w.healthy && serves(w, model));
  if (pre.length === 0 || dec.length === 0) return undefined;
  if (pre.some((p) => hasDecodeFor(p, decode, model))) return undefined;
  const names = (ws: WorkerRef[]) => [...new Set(ws.map((w) => `'${w.model}'`))].join(', ');
  return `model mismatch: the prefill workers serve ${names(pre)}, the decode workers ${names(dec)}; a decode cannot load another model's KV`;
}
