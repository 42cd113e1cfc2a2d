// Pairing a prefill's finished requests with decodes' registrations (vLLM's
// _pop_matching_registration / _pop_matching_finished_blocks): the exact id
// first, else the id without its "-xxxxxxxx" suffix on both sides. Unlike
// vLLM, a base id shared by two live entries pairs with neither (vLLM may
// WRITE one request's KV into the other's blocks), registrations are bounded
// in number and age, and a registration is keyed by (decode engine, request
// id, sending rank): several decode ranks register one request with one
// prefill rank (each is kept, its blocks are its own), the same rank's copy
// again is a duplicate, and two decodes sharing an id are never conflated.
// Every operation is O(log n) or better: no scan of all registrations.
import type { PushRegistration } from './push-reg';
import { baseRequestId } from './push-reg';

/** A registration as received. @internal */
export interface ReceivedReg {
  reg: PushRegistration;
  /** The agent that sent it (its decode's rank). */
  from: string;
  /** performance.now() at receipt. */
  at: number;
  /** Until when (performance.now() ms) the decode waits: no WRITE after. */
  deadlineAt: number;
}

/** Why a registration was not stored. @internal */
export type RegRefusal = 'duplicate' | 'full';

/** One decode request: (decode engine, request id). @internal */
export const decodeKey = (r: ReceivedReg): string => `${r.reg.decodeEngineId}\0${r.reg.requestId}`;
/** One decode rank's registration of one request. @internal */
export const rankKey = (r: ReceivedReg): string => `${decodeKey(r)}\0${r.from}`;

/** Registrations waiting for their request, and those seen lately (duplicates). @internal */
export class RegistrationStore {
  /** Waiting, by decode request, then by sending rank. */
  readonly #pending = new Map<string, Map<string, ReceivedReg>>();
  /** Decode requests waiting, by base request id. */
  readonly #byBase = new Map<string, Set<string>>();
  /** Expiry (deadline or age) of each waiting registration; stale entries are skipped. */
  readonly #expiry = new MinHeap<{ at: number; r: ReceivedReg }>();
  /** Rank keys seen (waiting, paired or dropped), in arrival order (one TTL: expiry order), until when. */
  readonly #seen = new Map<string, number>();
  readonly #max: number;
  readonly #maxSeen: number;
  readonly #ttlMs: number;
  #count = 0;

  constructor(max: number, ttlMs: number, maxSeen = Math.max(1024, 8 * max)) {
    this.#max = max;
    this.#ttlMs = ttlMs;
    this.#maxSeen = maxSeen;
  }

  /** Registrations waiting (those past their decode's deadline or their age are dropped first). */
  get size(): number {
    this.#prune(performance.now());
    return this.#count;
  }

  /** Rank keys remembered as seen (bounded). */
  get seen(): number {
    return this.#seen.size;
  }

  /** Records a registration as seen; 'duplicate' if this rank's copy was seen within the TTL. */
  see(r: ReceivedReg): RegRefusal | undefined {
    this.#prune(r.at);
    const k = rankKey(r);
    if (this.#seen.has(k)) return 'duplicate';
    this.#seen.set(k, r.at + this.#ttlMs);
    // Bounded: the oldest are forgotten first (a copy of one of those is then no longer a duplicate).
    while (this.#seen.size > this.#maxSeen) this.#seen.delete(this.#seen.keys().next().value as string);
    return undefined;
  }

  /** Stores a registration already seen; 'full' if too many wait. */
  add(r: ReceivedReg): RegRefusal | undefined {
    this.#prune(r.at);
    if (this.#count >= this.#max) return 'full';
    const d = decodeKey(r);
    let g = this.#pending.get(d);
    if (!g) {
      g = new Map();
      this.#pending.set(d, g);
      addTo(this.#byBase, baseRequestId(r.reg.requestId), d);
    }
    if (!g.has(r.from)) this.#count++;
    g.set(r.from, r);
    this.#expiry.push({ at: Math.min(r.deadlineAt, r.at + this.#ttlMs), r });
    // Entries of registrations taken since stay until their expiry: rebuilt from the live ones when they pile up.
    if (this.#expiry.size > 2 * this.#max + 1024) {
      this.#expiry.clear();
      for (const g2 of this.#pending.values())
        for (const x of g2.values()) this.#expiry.push({ at: Math.min(x.deadlineAt, x.at + this.#ttlMs), r: x });
    }
    return undefined;
  }

  /**
   * The one decode request a prefill request id pairs with (exact, else one
   * unambiguous base id): its ranks' registrations, oldest first. Two
   * candidates (two decodes, or two base-id matches) pair with neither.
   */
  candidate(prefillId: string, now: number): ReceivedReg[] | undefined {
    this.#prune(now);
    const keys = [...(this.#byBase.get(baseRequestId(prefillId)) ?? [])];
    const first = (k: string) => this.#pending.get(k)!.values().next().value as ReceivedReg;
    const exact = keys.filter((k) => first(k).reg.requestId === prefillId);
    const hits = exact.length ? exact : keys.filter((k) => sameBase(first(k).reg.requestId, prefillId));
    if (hits.length !== 1) return undefined;
    return [...this.#pending.get(hits[0])!.values()].sort((a, b) => a.at - b.at);
  }

  /** Removes and returns a decode request's waiting registrations (it paired), oldest first. */
  take(decode: string): ReceivedReg[] {
    const g = this.#pending.get(decode);
    if (!g) return [];
    const rs = [...g.values()].sort((a, b) => a.at - b.at);
    this.#count -= g.size;
    this.#unlink(decode, rs[0].reg.requestId);
    return rs;
  }

  #unlink(decode: string, requestId: string): void {
    this.#pending.delete(decode);
    removeFrom(this.#byBase, baseRequestId(requestId), decode);
  }

  #prune(now: number): void {
    for (let top = this.#expiry.peek(); top && top.at <= now; top = this.#expiry.peek()) {
      this.#expiry.pop();
      const g = this.#pending.get(decodeKey(top.r));
      if (g?.get(top.r.from) !== top.r) continue;
      g.delete(top.r.from);
      this.#count--;
      if (g.size === 0) this.#unlink(decodeKey(top.r), top.r.reg.requestId);
    }
    for (const [k, until] of this.#seen) {
      if (until > now) break;
      this.#seen.delete(k);
    }
  }
}

/** The one offer a registration's decode id pairs with: exact, else one unambiguous base id. @internal */
export function matchOffer<T>(
  decodeId: string,
  offers: Map<string, T>,
  byBase: Map<string, Set<string>>,
): { id: string; offer: T } | undefined {
  const exact = offers.get(decodeId);
  if (exact) return { id: decodeId, offer: exact };
  const ids = [...(byBase.get(baseRequestId(decodeId)) ?? [])].filter((id) => sameBase(id, decodeId));
  return ids.length === 1 ? { id: ids[0], offer: offers.get(ids[0])! } : undefined;
}

/** Whether two ranks' registrations of one request name the same blocks and decode address. @internal */
export function sameRegistration(x: PushRegistration, y: PushRegistration): boolean {
  const a = x.localBlockIds[0];
  const b = y.localBlockIds[0];
  return (
    a.length === b.length &&
    a.every((v, i) => v === b[i]) &&
    x.decodeHost === y.decodeHost &&
    x.decodePort === y.decodePort &&
    x.decodeTpSize === y.decodeTpSize
  );
}

/** Whether two ids have the same base id and a suffix was stripped from at least one (vLLM's fallback). */
export function sameBase(a: string, b: string): boolean {
  const x = baseRequestId(a);
  const y = baseRequestId(b);
  return x === y && (x !== a || y !== b);
}

/** Adds to a map of sets. @internal */
export function addTo<K, V>(m: Map<K, Set<V>>, k: K, v: V): void {
  const s = m.get(k);
  if (s) s.add(v);
  else m.set(k, new Set([v]));
}

/** Removes from a map of sets (an emptied set goes). @internal */
export function removeFrom<K, V>(m: Map<K, Set<V>>, k: K, v: V): void {
  const s = m.get(k);
  s?.delete(v);
  if (s?.size === 0) m.delete(k);
}

/** A binary min-heap on `at`. */
class MinHeap<T extends { at: number }> {
  #a: T[] = [];
  get size(): number {
    return this.#a.length;
  }
  clear(): void {
    this.#a = [];
  }
  peek(): T | undefined {
    return this.#a[0];
  }
  push(x: T): void {
    const a = this.#a;
    a.push(x);
    for (let i = a.length - 1; i > 0; ) {
      const p = (i - 1) >> 1;
      if (a[p].at <= a[i].at) break;
      [a[p], a[i]] = [a[i], a[p]];
      i = p;
    }
  }
  pop(): T | undefined {
    const a = this.#a;
    const top = a[0];
    const last = a.pop();
    if (a.length && last) {
      a[0] = last;
      for (let i = 0; ; ) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < a.length && a[l].at < a[m].at) m = l;
        if (r < a.length && a[r].at < a[m].at) m = r;
        if (m === i) break;
        [a[m], a[i]] = [a[i], a[m]];
        i = m;
      }
    }
    return top;
  }
}
