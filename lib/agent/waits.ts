// The promises waiting on transfers, by request id. A posting's waits settle
// once: from its completion event, from a state check or post that finds it
// ended on the JS thread, or when the handle is released or the agent closed.
import { guardWait } from './guard-wait';
import type { WaitOptions } from './types';

interface Waiter {
  resolve(): void;
  reject(e: Error): void;
}

export class XferWaits {
  /** Read directly on the post path (`size`, `has`): a method call there costs more than the check. */
  readonly byId = new Map<number, Waiter[]>();

  /** A promise settled by settle(id), or by the timeout or abort in opts. */
  add(id: number, opts: WaitOptions): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const cleanup = guardWait(opts, reject, () => this.#remove(id, w), 'transfer');
      const w: Waiter = {
        resolve: () => {
          cleanup();
          resolve();
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
      };
      const list = this.byId.get(id);
      if (list) list.push(w);
      else this.byId.set(id, [w]);
    });
  }

  /** Settles every wait on id: resolved, or rejected with err. */
  settle(id: number, err?: Error): void {
    const list = this.byId.get(id);
    if (!list) return;
    this.byId.delete(id);
    for (const w of list) {
      if (err) w.reject(err);
      else w.resolve();
    }
  }

  /** Rejects every wait (the agent closed). */
  rejectAll(err: Error): void {
    for (const id of [...this.byId.keys()]) this.settle(id, err);
  }

  #remove(id: number, w: Waiter): void {
    const list = this.byId.get(id);
    if (!list) return;
    const i = list.indexOf(w);
    if (i >= 0) list.splice(i, 1);
    if (list.length === 0) this.byId.delete(id);
  }
}
