// Notifications an agent received: queued until read (getNewNotifs) or
// taken by a waiter (waitForNotif). While someone waits, the addon keeps the
// process alive for them and the engine looks for notifications often
// (watchNotifs): each look's delay is a hop of a handshake that waits on one.
import type { NativeAgent } from '../native';
import { guardWait } from './guard-wait';
import type { Notif, NotifMsg, WaitOptions } from './types';

interface Watcher {
  take(n: Notif): boolean;
  reject(e: Error): void;
}

export class NotifInbox {
  readonly #native: NativeAgent;
  readonly #closed: () => boolean;
  readonly #queue: Notif[] = [];
  readonly #watchers = new Set<Watcher>();

  constructor(native: NativeAgent, closed: () => boolean) {
    this.#native = native;
    this.#closed = closed;
  }

  /** Whether a waitForNotif is pending (then every event pumps). */
  get watched(): boolean {
    return this.#watchers.size > 0;
  }

  /** All notifications received since the last call, by sender. */
  takeAll(): Map<string, Buffer[]> {
    this.#pump();
    const out = new Map<string, Buffer[]>();
    for (const n of this.#queue.splice(0)) {
      const l = out.get(n.agent);
      if (l) l.push(n.msg);
      else out.set(n.agent, [n.msg]);
    }
    return out;
  }

  /** The first notification that matches, consumed; see NixlAgent.waitForNotif. */
  waitFor(match: { agent?: string; msg?: NotifMsg } | ((n: Notif) => boolean), opts: WaitOptions): Promise<Notif> {
    const pred = typeof match === 'function' ? match : notifMatcher(match);
    this.#pump();
    const i = this.#queue.findIndex(pred);
    if (i >= 0) return Promise.resolve(this.#queue.splice(i, 1)[0]);
    return new Promise<Notif>((resolve, reject) => {
      const watcher: Watcher = {
        take: (n) => {
          if (!pred(n)) return false;
          cleanup();
          resolve(n);
          return true;
        },
        reject: (e) => {
          cleanup();
          reject(e);
        },
      };
      const cleanup = guardWait(
        opts,
        reject,
        () => {
          this.#watchers.delete(watcher);
          if (this.#watchers.size === 0 && !this.#closed()) this.#native.watchNotifs(false);
        },
        'notification',
      );
      this.#watchers.add(watcher);
      this.#native.watchNotifs(true);
      // A notification that landed between the pump above and watchNotifs(true)
      // signalled nobody: look once more now that the watch is on.
      this.deliver();
    });
  }

  /** Reads what arrived and hands it to the waiters. */
  deliver(): void {
    this.#pump();
    for (let i = 0; i < this.#queue.length && this.#watchers.size > 0; ) {
      let taken = false;
      for (const w of this.#watchers) {
        if (w.take(this.#queue[i])) {
          taken = true;
          break;
        }
      }
      if (taken) this.#queue.splice(i, 1);
      else i++;
    }
  }

  /** Rejects every waiter (the agent closed). */
  rejectAll(err: Error): void {
    for (const w of [...this.#watchers]) w.reject(err);
  }

  #pump(): void {
    if (this.#closed()) return;
    const raw = this.#native.getNotifs();
    for (let i = 0; i < raw.length; i += 2) this.#queue.push({ agent: raw[i] as string, msg: raw[i + 1] as Buffer });
  }
}

function notifMatcher(m: { agent?: string; msg?: NotifMsg }): (n: Notif) => boolean {
  const want = m.msg === undefined ? undefined : Buffer.from(m.msg as Uint8Array | string);
  return (n) => (m.agent === undefined || n.agent === m.agent) && (want === undefined || want.equals(n.msg));
}
