// Pairing a prefill's finished requests with decodes' registrations (vLLM's
// _pop_matching_registration / _pop_matching_finished_blocks): the exact id
// first, else the id without its "-xxxxxxxx" suffix on both sides. Unlike
// vLLM, a base id shared by two live entries pairs with neither (vLLM may
// WRITE one request's KV into the other's blocks), registrations are bounded
// in number and age, and a registration already seen is a duplicate (several
// decode ranks register one request with one prefill rank).
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

/** Registrations waiting for their request, and those seen lately (duplicates). @internal */
export class RegistrationStore {
  readonly #pending = new Map<string, ReceivedReg>();
  /** Decode ids seen (pending, paired or dropped), until when they count as duplicates. */
  readonly #seen = new Map<string, number>();
  readonly #max: number;
  readonly #ttlMs: number;

  constructor(max: number, ttlMs: number) {
    this.#max = max;
    this.#ttlMs = ttlMs;
  }

  /** Registrations waiting (those past their decode's deadline or their age are dropped first). */
  get size(): number {
    this.#prune(performance.now());
    return this.#pending.size;
  }

  /** Stores a registration; a refusal says why not. */
  add(r: ReceivedReg): RegRefusal | undefined {
    this.#prune(r.at);
    if (this.#seen.has(r.reg.requestId)) return 'duplicate';
    if (this.#pending.size >= this.#max) return 'full';
    this.#pending.set(r.reg.requestId, r);
    this.#seen.set(r.reg.requestId, r.at + this.#ttlMs);
    return undefined;
  }

  /** The registration for a prefill request id (exact, else one unambiguous base id), removed. */
  take(prefillId: string, now: number): ReceivedReg | undefined {
    this.#prune(now);
    const exact = this.#pending.get(prefillId);
    const hit = exact ?? unique([...this.#pending.values()].filter((r) => sameBase(r.reg.requestId, prefillId)));
    if (hit) this.#pending.delete(hit.reg.requestId);
    return hit;
  }

  /** Drops a pending registration (after its push failed, say). */
  drop(decodeId: string): void {
    this.#pending.delete(decodeId);
  }

  #prune(now: number): void {
    for (const [id, r] of this.#pending) if (r.deadlineAt <= now || r.at + this.#ttlMs <= now) this.#pending.delete(id);
    for (const [id, until] of this.#seen) if (until <= now && !this.#pending.has(id)) this.#seen.delete(id);
  }
}

/** The one offer a registration's decode id pairs with: exact, else one unambiguous base id. @internal */
export function matchOffer<T>(decodeId: string, offers: Map<string, T>): { id: string; offer: T } | undefined {
  const exact = offers.get(decodeId);
  if (exact) return { id: decodeId, offer: exact };
  const ids = [...offers.keys()].filter((id) => sameBase(id, decodeId));
  return ids.length === 1 ? { id: ids[0], offer: offers.get(ids[0])! } : undefined;
}

/** Whether two ids have the same base id and a suffix was stripped from at least one (vLLM's fallback). */
function sameBase(a: string, b: string): boolean {
  const x = baseRequestId(a);
  const y = baseRequestId(b);
  return x === y && (x !== a || y !== b);
}

function unique<T>(xs: T[]): T | undefined {
  return xs.length === 1 ? xs[0] : undefined;
}
