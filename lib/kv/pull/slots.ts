// Pull slots per remote engine: at most `max` pulls in flight to one engine,
// the rest queued for that engine only, so one stalled prefill holds up no
// pull from another.
import { NixlError } from '../../errors';

interface Queue {
  active: number;
  waiting: Array<() => void>;
}

/** @internal */
export class EngineSlots {
  readonly #max: number;
  readonly #queues = new Map<string, Queue>();

  constructor(max: number) {
    this.#max = max;
  }

  /** Takes a slot for engine `key`, waiting in its queue when all are taken; rejects (CANCELED) on abort. */
  async acquire(key: string, signal?: AbortSignal): Promise<void> {
    let q = this.#queues.get(key);
    if (!q) {
      q = { active: 0, waiting: [] };
      this.#queues.set(key, q);
    }
    const slots = q;
    if (slots.active < this.#max) {
      slots.active++;
      return;
    }
    await new Promise<void>((resolve, reject) => {
      const go = () => {
        signal?.removeEventListener('abort', onAbort);
        slots.active++;
        resolve();
      };
      const onAbort = () => {
        const i = slots.waiting.indexOf(go);
        if (i >= 0) slots.waiting.splice(i, 1);
        reject(new NixlError('pull aborted while queued', 'NIXL_ERR_CANCELED', undefined, { cause: signal?.reason }));
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      slots.waiting.push(go);
    });
  }

  /** Gives a slot of engine `key` back: to the next queued pull, if any. */
  release(key: string): void {
    const q = this.#queues.get(key);
    if (!q) return;
    q.active--;
    const next = q.waiting.shift();
    if (next) next();
    else if (q.active === 0) this.#queues.delete(key);
  }

  /** Slots taken, all engines together. */
  active(): number {
    let n = 0;
    for (const q of this.#queues.values()) n += q.active;
    return n;
  }
}
