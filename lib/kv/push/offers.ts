// The requests a push prefill offers: each one's blocks are held from
// offer() until its WRITEs complete, it is aborted, or its lease ends
// (kv_lease_duration, extended by "HB:" heartbeats naming it), whichever first.
import type { ReceivedReg } from './pairing';
import { addTo, removeFrom } from './pairing';
import { baseRequestId } from './reg';
import type { PushSenderStats, PushSent } from './types';

/** One offered request. @internal */
export interface Offer {
  requestId: string;
  blockIds: number[];
  /** The decode must register exactly as many blocks (the KV is one whole). */
  exact: boolean;
  leaseEnd: number;
  timer: NodeJS.Timeout;
  /** Paired and pushing to this decode request (decodeKey); its ranks' registrations by sending agent. */
  decode?: string;
  regs: Map<string, ReceivedReg>;
  /** Wakes a push waiting for a decode rank's registration. */
  wake?: () => void;
  settle(r: Omit<PushSent, 'requestId' | 'blockIds'>): void;
  settled: boolean;
}

/** The offers of one sender, by id and by base id (pairing by base id without a scan). @internal */
export class Offers {
  readonly byId = new Map<string, Offer>();
  readonly byBase = new Map<string, Set<string>>();
  readonly #stats: PushSenderStats;

  constructor(stats: PushSenderStats) {
    this.#stats = stats;
  }

  /** Holds `ids` for `requestId` until the offer settles (at the lease end at the latest). */
  open(requestId: string, ids: number[], exact: boolean, leaseMs: number): { offer: Offer; sent: Promise<PushSent> } {
    let offer!: Offer;
    const sent = new Promise<PushSent>((resolve) => {
      const o: Offer = {
        requestId,
        blockIds: ids,
        exact,
        leaseEnd: performance.now() + leaseMs,
        timer: undefined as never,
        regs: new Map(),
        settled: false,
        settle: (s) => {
          if (o.settled) return;
          o.settled = true;
          clearTimeout(o.timer);
          o.wake?.();
          if (this.byId.get(requestId) === o) this.#remove(requestId);
          if (s.reason === 'expired') this.#stats.expired++;
          else if (s.reason === 'failed') this.#stats.failed++;
          else if (s.reason === 'written') this.#stats.written++;
          resolve({ requestId, blockIds: ids, ...s });
        },
      };
      offer = o;
    });
    this.byId.set(requestId, offer);
    addTo(this.byBase, baseRequestId(requestId), requestId);
    this.#arm(offer);
    return { offer, sent };
  }

  #remove(requestId: string): void {
    this.byId.delete(requestId);
    removeFrom(this.byBase, baseRequestId(requestId), requestId);
  }

  #arm(o: Offer): void {
    clearTimeout(o.timer);
    o.timer = setTimeout(
      () => {
        if (o.settled) return;
        if (performance.now() >= o.leaseEnd) o.settle({ reason: 'expired', bytes: 0, writes: 0 });
        else this.#arm(o);
      },
      Math.max(0, o.leaseEnd - performance.now()),
    );
  }

  /** vLLM's _handle_heartbeat: the lease of each offer named becomes max(old, now + 2/3 lease). */
  heartbeat(ids: string[], leaseMs: number): void {
    this.#stats.heartbeats++;
    const until = performance.now() + Math.floor((leaseMs * 2) / 3);
    for (const id of ids) {
      const o = this.byId.get(id);
      if (o && until > o.leaseEnd) o.leaseEnd = until;
    }
  }

  get size(): number {
    return this.byId.size;
  }

  /** Settles every offer (the sender closes). */
  settleAll(s: Omit<PushSent, 'requestId' | 'blockIds'>): void {
    for (const o of [...this.byId.values()]) o.settle(s);
  }
}
