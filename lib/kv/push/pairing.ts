// Pairing a prefill's finished requests with decodes' registrations (vLLM's
// _pop_matching_registration / _pop_matching_finished_blocks): the exact id
// first, else the id without its "-xxxxxxxx" suffix on both sides. Unlike
// vLLM, a base id shared by two live entries pairs with neither (vLLM may
// WRITE one request's KV into the other's blocks), registrations are bounded
// in number and age, and a registration is keyed by (decode engine, request
// id, sending rank): several decode ranks register one request with one
// prefill rank (each is kept, its blocks are its own), the same rank's copy
// again is a duplicate, and two decodes sharing an id are never conflated.
// What waits is bounded per sending agent, per decode engine and in bytes
// (push-reg-quota.ts): the heaviest sender's oldest registrations make room.
// Every operation is O(log n) or better: no scan of all registrations.
import { MinHeap } from './min-heap';
import type { PushRegistration } from './reg';
import { baseRequestId } from './reg';
import { type ReceivedReg, type RegQuota, Tally, oldest, regCost, regQuota, shareOf } from './reg-quota';

export type { ReceivedReg } from './reg-quota';

/** Why a registration was not stored. @internal */
export type RegRefusal = 'duplicate';

/** A registration given up to make room for another (its sender is told), and why. @internal */
export interface Evicted {
  r: ReceivedReg;
  why: string;
}

/** What add() did: the registration kept (else why not), and those given up for it. @internal */
export interface Added {
  refused?: string;
  evicted: Evicted[];
}

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
  /** Waiting, by sending agent; and by decode engine, then sending agent. */
  readonly #agents = new Tally();
  readonly #engines = new Map<string, Tally>();
  readonly #q: RegQuota;
  readonly #maxSeen: number;
  readonly #ttlMs: number;
  #count = 0;

  /** `quota`: as regQuota() resolves KvPushSender's options (default: regQuota of `max`). */
  constructor(max: number, ttlMs: number, maxSeen = Math.max(1024, 8 * max), quota?: RegQuota) {
    this.#q = quota ?? regQuota({ maxPendingRegistrations: max });
    this.#ttlMs = ttlMs;
    this.#maxSeen = maxSeen;
  }

  /** Registrations waiting (those past their decode's deadline or their age are dropped first). */
  get size(): number {
    this.#prune(performance.now());
    return this.#count;
  }

  /** What the waiting registrations cost, bytes (regCost). */
  get bytes(): number {
    this.#prune(performance.now());
    return this.#agents.bytes;
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

  /**
   * Stores a registration already seen, within the quota: over its agent's
   * share that agent's oldest go, over its decode engine's share the oldest
   * of that engine's heaviest agent, over the store's the oldest of the
   * heaviest agent of all. Refused only when it alone is over an agent's share.
   */
  add(r: ReceivedReg): Added {
    this.#prune(r.at);
    const q = this.#q;
    const cost = regCost(r);
    const agentBytes = shareOf(q, q.perAgent);
    const engineBytes = shareOf(q, q.perEngine);
    if (cost > Math.min(agentBytes, engineBytes))
      return {
        refused: `its ${r.reg.localBlockIds[0].length} block ids cost ${cost} bytes, over the ${Math.min(agentBytes, engineBytes)} one sender may keep waiting`,
        evicted: [],
      };
    // The same rank again (its earlier copy no longer remembered as seen): the newer one replaces it.
    const same = this.#pending.get(decodeKey(r))?.get(r.from);
    if (same) this.#drop(same);
    const evicted: Evicted[] = [];
    const evict = (x: ReceivedReg, why: string) => {
      this.#drop(x);
      evicted.push({ r: x, why });
    };
    const eid = r.reg.decodeEngineId;
    for (let u = this.#agents.usage(r.from); u && (u.n >= q.perAgent || u.bytes + cost > agentBytes); ) {
      evict(oldest(u), `evicted: agent '${r.from}' is over its quota (${q.perAgent} waiting, ${agentBytes} bytes)`);
      u = this.#agents.usage(r.from);
    }
    for (let e = this.#engines.get(eid); e && (e.n >= q.perEngine || e.bytes + cost > engineBytes); ) {
      const why = `evicted: decode engine '${eid}' is over its quota (${q.perEngine} waiting, ${engineBytes} bytes) and its agent '%s' holds the most`;
      const x = e.heaviestOldest()!;
      evict(x, why.replace('%s', x.from));
      e = this.#engines.get(eid);
    }
    while (this.#count >= q.max || this.#agents.bytes + cost > q.maxBytes) {
      const x = this.#agents.heaviestOldest()!;
      evict(
        x,
        `evicted: the prefill's registrations are full (${q.max} waiting, ${q.maxBytes} bytes) and agent '${x.from}' holds the most`,
      );
    }
    this.#compact();
    this.#insert(r, cost);
    return { evicted };
  }

  #insert(r: ReceivedReg, cost: number): void {
    const d = decodeKey(r);
    let g = this.#pending.get(d);
    if (!g) {
      g = new Map();
      this.#pending.set(d, g);
      addTo(this.#byBase, baseRequestId(r.reg.requestId), d);
    }
    g.set(r.from, r);
    this.#count++;
    const rk = rankKey(r);
    this.#agents.add(r.from, rk, r, cost);
    let e = this.#engines.get(r.reg.decodeEngineId);
    if (!e) {
      e = new Tally();
      this.#engines.set(r.reg.decodeEngineId, e);
    }
    e.add(r.from, rk, r, cost);
    this.#expiry.push({ at: Math.min(r.deadlineAt, r.at + this.#ttlMs), r });
  }

  /**
   * Entries of registrations taken or evicted stay in the expiry heap, and
   * hold their block lists, until their expiry: once they outnumber the live
   * ones the heap is rebuilt from those (amortized O(1) a removal), so what
   * is held follows what waits, not what went through.
   */
  #compact(): void {
    if (this.#expiry.size <= 2 * this.#count + 64) return;
    this.#expiry.clear();
    for (const g of this.#pending.values())
      for (const x of g.values()) this.#expiry.push({ at: Math.min(x.deadlineAt, x.at + this.#ttlMs), r: x });
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
    for (const r of rs) this.#drop(r);
    this.#compact();
    return rs;
  }

  /** Removes one waiting registration (false if it is not the one waiting). */
  #drop(r: ReceivedReg): boolean {
    const d = decodeKey(r);
    const g = this.#pending.get(d);
    if (g?.get(r.from) !== r) return false;
    g.delete(r.from);
    this.#count--;
    if (g.size === 0) this.#unlink(d, r.reg.requestId);
    const cost = regCost(r);
    const rk = rankKey(r);
    this.#agents.remove(r.from, rk, cost);
    const e = this.#engines.get(r.reg.decodeEngineId);
    e?.remove(r.from, rk, cost);
    if (e?.n === 0) this.#engines.delete(r.reg.decodeEngineId);
    return true;
  }

  #unlink(decode: string, requestId: string): void {
    this.#pending.delete(decode);
    removeFrom(this.#byBase, baseRequestId(requestId), decode);
  }

  #prune(now: number): void {
    for (let top = this.#expiry.peek(); top && top.at <= now; top = this.#expiry.peek()) {
      this.#expiry.pop();
      this.#drop(top.r);
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
