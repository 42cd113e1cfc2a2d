// What a push prefill lets its peers keep waiting: registrations for requests
// it has not seen yet are bounded in count and bytes, per sending agent, per
// decode engine (as the registrations name it) and in all. Any peer that
// handshaked may send well-formed registrations for requests that never
// come; without a KV secret nothing says which are real. So when a bound is
// reached the registrations given up are the heaviest sender's, oldest
// first: a flooder loses its own before anyone else loses one. The store
// (push-pairing.ts) applies it; the sender refuses each one given up.
import { MinHeap } from './min-heap';
import type { PushRegistration } from './reg';

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

/** Bounds on registrations waiting for their request (KvPushSender options, resolved). @internal */
export interface RegQuota {
  /** Registrations waiting, in all. */
  max: number;
  /** Their cost in all (regCost), bytes. */
  maxBytes: number;
  /** Registrations one sending agent may keep waiting; its bytes: the same share of maxBytes. */
  perAgent: number;
  /** Registrations naming one decode engine; its bytes: the same share of maxBytes. */
  perEngine: number;
}

/** Defaults: 4096 waiting, 64 MiB, a quarter of both per agent, half per decode engine. */
export function regQuota(o: {
  maxPendingRegistrations?: number;
  maxPendingRegistrationBytes?: number;
  maxPendingRegistrationsPerAgent?: number;
  maxPendingRegistrationsPerEngine?: number;
}): RegQuota {
  const max = Math.max(1, Math.floor(o.maxPendingRegistrations ?? 4096));
  const cap = (v: number | undefined, d: number) => Math.min(max, Math.max(1, Math.floor(v ?? d)));
  return {
    max,
    maxBytes: Math.max(REG_FIXED_COST, Math.floor(o.maxPendingRegistrationBytes ?? 64 << 20)),
    perAgent: cap(o.maxPendingRegistrationsPerAgent, max / 4),
    perEngine: cap(o.maxPendingRegistrationsPerEngine, max / 2),
  };
}

/** Bytes one scope may hold: its share of the byte budget. */
export const shareOf = (q: RegQuota, n: number): number => Math.floor((q.maxBytes * n) / q.max);

/** What a waiting registration is charged, whatever its strings: objects, maps, heap entries. */
const REG_FIXED_COST = 1024;
/** Per block id (V8 holds a decoded id list at about 9.4 bytes an id, measured): a bound with room. */
const BLOCK_ID_COST = 16;

/** What a waiting registration costs in memory, bytes (an upper estimate). */
export function regCost(r: ReceivedReg): number {
  let ids = 0;
  for (const g of r.reg.localBlockIds) ids += g.length;
  return REG_FIXED_COST + BLOCK_ID_COST * ids;
}

/** One sender's waiting registrations, oldest first. */
export interface Usage {
  n: number;
  bytes: number;
  /** By rank key, in arrival order. */
  regs: Map<string, ReceivedReg>;
}

/** Waiting registrations by sending agent, with the heaviest (most bytes) found in O(log n). @internal */
export class Tally {
  n = 0;
  bytes = 0;
  readonly #by = new Map<string, Usage>();
  /** (-bytes, agent) at each change; an entry whose bytes are no longer the agent's is skipped. */
  readonly #heavy = new MinHeap<{ at: number; key: string }>();

  usage(key: string): Usage | undefined {
    return this.#by.get(key);
  }

  add(key: string, rk: string, r: ReceivedReg, cost: number): void {
    let u = this.#by.get(key);
    if (!u) {
      u = { n: 0, bytes: 0, regs: new Map() };
      this.#by.set(key, u);
    }
    u.regs.set(rk, r);
    u.n++;
    u.bytes += cost;
    this.n++;
    this.bytes += cost;
    this.#mark(key, u);
  }

  remove(key: string, rk: string, cost: number): void {
    const u = this.#by.get(key);
    if (!u?.regs.delete(rk)) return;
    u.n--;
    u.bytes -= cost;
    this.n--;
    this.bytes -= cost;
    if (u.n === 0) this.#by.delete(key);
    else this.#mark(key, u);
  }

  /** The oldest registration of the agent holding the most bytes. */
  heaviestOldest(): ReceivedReg | undefined {
    for (let top = this.#heavy.peek(); top; top = this.#heavy.peek()) {
      const u = this.#by.get(top.key);
      if (u && u.bytes === -top.at) return oldest(u);
      this.#heavy.pop();
    }
    return undefined;
  }

  #mark(key: string, u: Usage): void {
    this.#heavy.push({ at: -u.bytes, key });
    if (this.#heavy.size > 4 * this.#by.size + 64) {
      this.#heavy.clear();
      for (const [k, v] of this.#by) this.#heavy.push({ at: -v.bytes, key: k });
    }
  }
}

/** A sender's oldest waiting registration. */
export const oldest = (u: Usage): ReceivedReg => u.regs.values().next().value as ReceivedReg;
