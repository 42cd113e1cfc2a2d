// What the proxy reads of a worker's health answer (its model, names,
// context size, where its KV and KV events are) and of a failed check, the
// same over HTTP and ZeroMQ.
import { parseKvEvents } from '../../fleet/record';
import { pushCoordinates } from '../handoff-push';
import type { WorkerRef } from '../pool';

/** ': <reason>' from a worker's unhealthy answer (nixl-node: reason; vLLM: error.message), or ''. */
export function reasonOf(body: Record<string, unknown> | undefined): string {
  const r = body?.reason ?? (body?.error as { message?: unknown } | undefined)?.message;
  return typeof r === 'string' && r.length > 0 ? `: ${r.slice(0, 200)}` : '';
}

export function causeOf(e: unknown): string {
  const err = e as Error & { code?: string; cause?: { code?: string; message?: string } };
  return (
    err.cause?.code ?? err.cause?.message ?? (err.code?.startsWith('UND_ERR') ? err.message : err.code) ?? err.message
  );
}

/** A JSON object, or undefined (vLLM's /health answers an empty body). */
export function parseObject(text: string): Record<string, unknown> | undefined {
  try {
    const v = JSON.parse(text) as unknown;
    return typeof v === 'object' && v !== null && !Array.isArray(v) ? (v as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}

/** What a nixl-node worker's health answer says of its model: its name and context size. */
export function healthFields(w: WorkerRef, h: Record<string, unknown> | undefined): void {
  if (typeof h?.model === 'string' && h.model.length <= 256) w.model = h.model;
  w.models = servedNames(h, w.model) ?? w.models;
  const len = h?.max_model_len;
  if (Number.isSafeInteger(len) && (len as number) > 0) w.maxModelLen = len as number;
  w.push = pushCoordinates(h);
  // Only a nixl-node answer (it names its model) says whether it publishes: vLLM's /health says nothing.
  if (typeof h?.model === 'string') w.kvEvents = kvEventsFields(h.kv_events);
}

/** Where a worker's health answer says it publishes KV events; undefined when it does not say so well. */
function kvEventsFields(x: unknown): WorkerRef['kvEvents'] {
  if (x === undefined) return undefined;
  const k = parseKvEvents(x);
  return typeof k === 'string' ? undefined : k;
}

/** The names a health answer lists (served_model_names), model first; undefined when it lists none that fit. */
function servedNames(h: Record<string, unknown> | undefined, model: string | undefined): string[] | undefined {
  const names = h?.served_model_names;
  if (model === undefined || !Array.isArray(names) || names.length > 64) return undefined;
  const ok = names.filter((n): n is string => typeof n === 'string' && n.length > 0 && n.length <= 256);
  return [...new Set([model, ...ok])];
}
