// The receives of a push decode waiting for their WRITE notifications
// ("<our id>:<prefill TP>", pp_size x max(1, P_tp // D_tp) of them) and for
// refusals from the prefill, on one notification listener. Each failure is
// classified where it is seen: the wait records its kind before it rejects.
import type { NixlAgent, Notif } from '../../agent';
import { NixlError } from '../../errors';
import { ucxErrorMode, ucxModeHint } from '../../ucx';
import { listenNotifs } from '../notifs';
import { PUSH_REFUSED_PREFIX, decodeRefusal } from './reg';
import type { PushFailure } from './types';

/** One receive waiting for its WRITEs. @internal */
export interface Waiting {
  requestId: string;
  /** The prefill agents registered with: only their notifications count. */
  agents: ReadonlySet<string>;
  expected: number;
  prefillTp: number;
  count: number;
  from: Set<string>;
  /** Why the wait failed, once it did. */
  failedAs?: PushFailure;
  done(fail?: { kind: PushFailure; error: NixlError }): void;
}

const WRITE_NOTIF = /^(.+):(\d+)$/s;

/** @internal */
export class WriteWaits {
  readonly #agent: NixlAgent;
  readonly #waiting = new Map<string, Waiting>();
  /** Ids given up on, until when a WRITE notification for them is expected as late. */
  readonly #gaveUp = new Map<string, number>();
  readonly #abort = new AbortController();
  #loop: Promise<void> | undefined;
  /** WRITE notifications for a request after it failed (its blocks were in quarantine). */
  lateWrites = 0;
  /** Notifications naming no receive of ours. */
  unrecognized = 0;

  constructor(agent: NixlAgent) {
    this.#agent = agent;
  }

  get size(): number {
    return this.#waiting.size;
  }

  get gaveUpSize(): number {
    return this.#gaveUp.size;
  }

  /** Whether `requestId` is waiting, or failed and its WRITEs may still come. */
  busy(requestId: string): boolean {
    this.#forgetGaveUp();
    return this.#waiting.has(requestId) || this.#gaveUp.has(requestId);
  }

  /** A WRITE for `requestId` is expected as late until `until` (performance.now() ms). */
  gaveUp(requestId: string, until: number): void {
    this.#gaveUp.set(requestId, until);
  }

  /** Ids given up on whose WRITEs can no longer come (each receive and late WRITE prunes: bounded by failures in that window). */
  #forgetGaveUp(): void {
    const now = performance.now();
    for (const [k, until] of this.#gaveUp) if (until <= now) this.#gaveUp.delete(k);
  }

  /** Waits for `expected` WRITE notifications of `requestId` (one posting: this call's), by `deadline`. */
  wait(
    requestId: string,
    agents: ReadonlySet<string>,
    expected: number,
    prefillTp: number,
    deadline: number,
    signal?: AbortSignal,
  ): { w: Waiting; written: Promise<Waiting> } {
    this.#loop ??= listenNotifs(
      this.#agent,
      (n) => this.#mine(n),
      (n) => this.#onNotif(n),
      this.#abort.signal,
    );
    let w!: Waiting;
    const written = new Promise<Waiting>((resolve, reject) => {
      const entry: Waiting = {
        requestId,
        agents,
        expected,
        prefillTp,
        count: 0,
        from: new Set(),
        done: (fail) => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
          if (this.#waiting.get(requestId) === entry) this.#waiting.delete(requestId);
          if (!fail) return resolve(entry);
          entry.failedAs ??= fail.kind;
          reject(fail.error);
        },
      };
      w = entry;
      const timer = setTimeout(
        () =>
          entry.done({
            kind: 'timeout',
            error: new NixlError(
              `${entry.count} of ${expected} WRITE notifications came before the deadline`,
              'NIXL_ERR_TIMEOUT',
            ),
          }),
        Math.max(0, deadline - performance.now()),
      );
      const onAbort = () => entry.done(aborted('receive aborted'));
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      this.#waiting.set(requestId, entry);
    });
    return { w, written };
  }

  /** Ends the wait of `requestId` if it still waits (its receive ended). */
  end(requestId: string): void {
    this.#waiting.get(requestId)?.done(aborted('receive ended'));
    this.#waiting.delete(requestId);
  }

  #mine(n: Notif): boolean {
    const msg = n.msg.toString('utf8');
    const id = msg.startsWith(PUSH_REFUSED_PREFIX) ? decodeRefusal(msg)?.requestId : WRITE_NOTIF.exec(msg)?.[1];
    return id !== undefined && (this.#waiting.has(id) || this.#gaveUp.has(id));
  }

  #onNotif(n: Notif): void {
    const msg = n.msg.toString('utf8');
    if (msg.startsWith(PUSH_REFUSED_PREFIX)) this.#onRefusal(n, msg);
    else this.#onWrite(n, msg);
  }

  /** A nixl-node prefill (one we registered with) will not write: the receive fails now, not at its deadline. */
  #onRefusal(n: Notif, msg: string): void {
    const r = decodeRefusal(msg)!;
    const w = this.#waiting.get(r.requestId);
    if (!w) return; // the receive had ended already
    if (!w.agents.has(n.agent)) {
      this.unrecognized++;
      return;
    }
    const e = new NixlError(`prefill agent '${n.agent}' refused to write it: ${r.reason}`, r.code);
    e.name = 'PushRefused';
    w.done({ kind: 'refused', error: e });
  }

  #onWrite(n: Notif, msg: string): void {
    const [, id, suffix] = WRITE_NOTIF.exec(msg)!;
    const w = this.#waiting.get(id);
    if (!w) {
      this.lateWrites++;
      this.#forgetGaveUp();
      return;
    }
    if (!w.agents.has(n.agent)) {
      // Not a prefill rank we registered with: it proves nothing.
      this.unrecognized++;
      return;
    }
    if (Number(suffix) !== w.prefillTp) {
      w.done(
        mismatch(
          `a WRITE notification says prefill TP ${suffix}, the params said ${w.prefillTp}: not counted, request failed`,
        ),
      );
      return;
    }
    if (w.from.has(n.agent)) {
      // Each prefill rank WRITEs once per decode rank: a second one is another push into our blocks.
      w.done(
        mismatch(
          `a second WRITE notification from prefill agent '${n.agent}': which WRITE landed last is unknown, request failed`,
        ),
      );
      return;
    }
    w.count++;
    w.from.add(n.agent);
    if (w.count >= w.expected) w.done();
  }

  /** A prefill agent our sends no longer reach: the receives waiting on it fail now. */
  unreachable(agentName: string, e: NixlError): void {
    for (const w of [...this.#waiting.values()])
      if (w.agents.has(agentName))
        w.done({
          kind: 'peer-gone',
          error: new NixlError(
            `prefill agent '${agentName}' cannot be reached since the registration (${e.message}): it is gone, or it ` +
              `could not connect back to this agent; ${ucxModeHint(ucxErrorMode(this.#agent))}`,
            'NIXL_ERR_REMOTE_DISCONNECT',
            undefined,
            { cause: e },
          ),
        });
  }

  /** Fails every receive waiting, then stops listening. */
  async close(): Promise<void> {
    for (const w of [...this.#waiting.values()]) w.done(aborted('push receiver closed'));
    this.#abort.abort();
    await this.#loop;
  }
}

function aborted(message: string): { kind: PushFailure; error: NixlError } {
  return { kind: 'aborted', error: new NixlError(message, 'NIXL_ERR_CANCELED') };
}

function mismatch(message: string): { kind: PushFailure; error: NixlError } {
  return { kind: 'mismatch', error: new NixlError(message, 'NIXL_ERR_MISMATCH') };
}
