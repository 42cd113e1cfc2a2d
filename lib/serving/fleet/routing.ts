// Routing by load with prefix affinity (the 'load' policy). A worker's load
// is the larger of what this proxy has outstanding on it and what it last
// reported through etcd (other proxies' requests included); a worker short
// of free KV blocks counts as loaded. A long prompt's prefix is hashed onto
// the prefill workers by rendezvous hashing (consistent: a worker joining or
// leaving moves only the prefixes it wins or held), so requests that share
// it reach the same prefill, whose prefix cache can then serve them, while
// that worker is not overloaded; otherwise, and without a prefix, the least
// loaded worker takes it (ties in turn).
import { createHash } from 'node:crypto';
import type { WorkerRef } from '../proxy/worker-ref';

/** How the 'load' policy weighs workers. */
export interface RoutingOptions {
  /** Characters of the prompt that make its affinity key (default 512; 0: no affinity). */
  prefixChars?: number;
  /** Prompts shorter than this have no affinity (default 128). */
  minPrefixChars?: number;
  /** A prefix's worker is passed over once its load exceeds the least loaded one's by more than this (default 4). */
  slack?: number;
  /** Below this fraction of free KV blocks a worker counts as full (default 0.05). */
  minFreeFraction?: number;
}

/** A worker's load: outstanding here, or reported (all proxies), whichever is larger; a full cache counts as loaded. */
export function loadOf(w: WorkerRef, o: RoutingOptions = {}): number {
  const r = w.reported;
  let load = Math.max(w.outstanding, r?.load ?? 0);
  if (r && r.totalBlocks > 0 && r.freeBlocks / r.totalBlocks < (o.minFreeFraction ?? 0.05)) load += 1000;
  return load;
}

function score(key: string, address: string): bigint {
  return createHash('sha256').update(key).update('\0').update(address).digest().readBigUInt64BE(0);
}

/** The workers in the order a key prefers them (rendezvous hashing). */
export function affinityOrder(key: string, from: readonly WorkerRef[]): WorkerRef[] {
  return from
    .map((w) => ({ w, s: score(key, w.address) }))
    .sort((a, b) => (a.s === b.s ? 0 : a.s > b.s ? -1 : 1))
    .map((x) => x.w);
}

/** The worker for a request: the key's worker unless overloaded, else the least loaded (ties: turn). */
export function pickByLoad(
  from: readonly WorkerRef[],
  turn: number,
  key: string | undefined,
  o: RoutingOptions = {},
): WorkerRef | undefined {
  if (from.length === 0) return undefined;
  const loads = from.map((w) => loadOf(w, o));
  const min = Math.min(...loads);
  if (key !== undefined) {
    const slack = o.slack ?? 4;
    for (const w of affinityOrder(key, from)) {
      // The first choice while it keeps up; the second when it does not, and so on.
      if (loadOf(w, o) - min <= slack) return w;
    }
  }
  const tied = from.filter((_, i) => loads[i] === min);
  return tied[turn % tied.length];
}

/** The prompt text a request starts with (completion prompt, or the chat messages' text in order). */
function promptText(body: Record<string, unknown>): string {
  const p = body.prompt;
  if (typeof p === 'string') return p;
  if (Array.isArray(p)) {
    if (typeof p[0] === 'string') return p[0];
    const tokens = Array.isArray(p[0]) ? p[0] : p; // token ids: one prompt, or the first of a batch
    return tokens.every((t) => typeof t === 'number') ? tokens.join(' ') : '';
  }
  const m = body.messages;
  if (!Array.isArray(m)) return '';
  let text = '';
  for (const msg of m) {
    const c = (msg as { content?: unknown })?.content;
    text += `${String((msg as { role?: unknown })?.role ?? '')}\n${typeof c === 'string' ? c : JSON.stringify(c ?? '')}\n`;
  }
  return text;
}

/** A request's affinity key (the start of its prompt), or undefined when its prompt is short. */
export function affinityKey(body: Record<string, unknown>, o: RoutingOptions = {}): string | undefined {
  const chars = o.prefixChars ?? 512;
  if (chars <= 0) return undefined;
  const text = promptText(body);
  if (text.length < (o.minPrefixChars ?? 128)) return undefined;
  return `${String(body.model ?? '')}\n${text.slice(0, chars)}`;
}
