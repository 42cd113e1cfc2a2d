// One push receive as a pipeline of named stages, each owning the kind a
// failure in it gets (PushError.kind), as a pull's stages do (pull/stages.ts):
//
//   admit      the deadline, the params, our blocks and whether we are open   setup
//   handshake  the prefill's agents, notif-only, by the deadline             handshake, timeout, mismatch, peer-gone
//   register   listen for its WRITEs, then send every rank the PUSH_REG      peer-gone (undelivered), handshake
//   wait       every WRITE notification, by the deadline (write-waits.ts)     timeout, refused, mismatch, peer-gone
//
// In every stage after admit, an abort (ours, or a canceled wait) is
// 'aborted'. Once the registration may have gone out, a failure puts the
// blocks into quarantine: a WRITE may still land until the prefill's lease
// is over.
import { NixlError } from '../../errors';
import type { WireProfile } from '../../handshake/model';
import type { RemoteEndpoint, RemoteEngine } from '../engine-connect';
import type { LeaseKeeper } from '../leases';
import { DEFAULT_LIMITS, checkRemoteSizes } from '../limits';
import type { ConnectAttempt } from '../remote-engines';
import type { PeerEngines } from '../peers';
import type { BlockQuarantine } from './quarantine';
import { type PushParams, encodePushReg, expectedWrites, isNotifId, parsePushParams } from './reg';
import {
  type KvPushReceiverOptions,
  PushError,
  type PushFailure,
  type PushReceived,
  type ReceiveOptions,
} from './types';
import type { Waiting, WriteWaits } from './write-waits';

/** What every receive of one receiver shares. @internal */
export interface ReceiveDeps {
  o: KvPushReceiverOptions;
  wire: WireProfile;
  /** The prefill's kv_lease_duration, ms. */
  leaseMs: number;
  engines: PeerEngines;
  leases: LeaseKeeper<RemoteEndpoint, RemoteEngine>;
  quarantine: BlockQuarantine;
  waits: WriteWaits;
  /** Local blocks of receives in flight. */
  inUse: Set<number>;
  send(agentName: string, msg: string | Buffer): boolean;
  isClosed(): boolean;
}

type Classify = (e: unknown) => PushFailure;

/** The first probe of the prefill's agents after a registration, ms (then doubling; see #probe). */
const PROBE_FIRST_MS = 100;
/** What the deadline a nixl-node prefill is told falls short of ours, ms (covers the registration's transit). */
const DEADLINE_SLACK_MS = 50;

const codeOf = (e: unknown): string | undefined => (e as NixlError)?.code;

/** What a failure to connect or deliver says by its code. */
function byCode(e: unknown): PushFailure {
  const code = codeOf(e);
  if (code === 'NIXL_ERR_TIMEOUT') return 'timeout';
  if (code === 'NIXL_ERR_REMOTE_DISCONNECT') return 'peer-gone';
  if (code === 'NIXL_ERR_MISMATCH' && (e as Error).name !== 'TransferModeError') return 'mismatch';
  return 'handshake';
}

/** One push receive of one request, run once. @internal */
export class PushReceive {
  readonly #d: ReceiveDeps;
  readonly #params: PushParams | Record<string, unknown>;
  readonly #r: ReceiveOptions;
  readonly #t0 = performance.now();
  #logical: number[] = [];
  #attempt: ConnectAttempt | undefined;
  #engine: RemoteEngine | undefined;
  /** The registration may have gone out: a failure quarantines the blocks. */
  #registered = false;

  constructor(deps: ReceiveDeps, params: PushParams | Record<string, unknown>, opts: ReceiveOptions) {
    this.#d = deps;
    this.#params = params;
    this.#r = opts;
  }

  async run(): Promise<PushReceived> {
    const { p, deadline } = this.#as('setup', () => this.#admit());
    const ep: RemoteEndpoint = {
      host: p.remoteHost,
      port: p.remotePort,
      tpSize: p.tpSize,
      ppSize: p.ppSize,
      engineId: p.remoteEngineId,
    };
    const release = this.#d.leases.hold(ep, p.remoteRequestId);
    for (const b of this.#logical) this.#d.inUse.add(b);
    let stopProbe = () => {};
    try {
      const engine = await this.#handshake(ep, deadline);
      const { w, written } = this.#register(engine, p, deadline);
      stopProbe = this.#probe(engine, p.remoteRequestId);
      await this.#wait(w, written);
      return {
        requestId: this.#r.requestId,
        notifications: w.count,
        writers: [...w.from],
        waitedMs: performance.now() - this.#t0,
      };
    } catch (e) {
      throw this.#failed(e);
    } finally {
      stopProbe();
      release();
      this.#d.waits.end(this.#r.requestId);
      for (const b of this.#logical) this.#d.inUse.delete(b);
    }
  }

  #fail(kind: PushFailure, e: unknown, quarantinedUntil?: number): PushError {
    return PushError.of(kind, e, this.#r.requestId, this.#logical, quarantinedUntil);
  }

  /** Runs f; what it throws fails the receive as `classify` says. */
  #as<T>(classify: PushFailure | Classify, f: () => T): T {
    const kind = typeof classify === 'string' ? () => classify : classify;
    try {
      const r = f();
      if (r instanceof Promise) return r.catch((e: unknown) => Promise.reject(this.#fail(kind(e), e))) as T;
      return r;
    } catch (e) {
      throw this.#fail(kind(e), e);
    }
  }

  /** The rule of every stage after admit, else undefined. */
  #common(e: unknown): PushFailure | undefined {
    return this.#r.signal?.aborted || codeOf(e) === 'NIXL_ERR_CANCELED' ? 'aborted' : undefined;
  }

  /** admit: the deadline, the params, and blocks in range, not in use, not in quarantine; the receiver open. */
  #admit(): { p: PushParams; deadline: number } {
    const r = this.#r;
    const timeoutMs = r.timeoutMs ?? this.#d.o.timeoutMs ?? 120_000;
    this.#logical = flatIds(r.localBlockIds);
    // A timer holds at most 2^31-1 ms (Node fires a longer one at once), and the registration carries it.
    if (!Number.isInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > 2 ** 31 - 1)
      throw new NixlError(`timeoutMs must be an integer in 1..2^31-1, got ${timeoutMs}`, 'NIXL_ERR_INVALID_PARAM');
    const p = 'remoteEngineId' in this.#params ? (this.#params as PushParams) : parsePushParams(this.#params);
    this.#checkBlocks(p);
    return { p, deadline: this.#t0 + timeoutMs };
  }

  #checkBlocks(p: PushParams): void {
    const { requestId } = this.#r;
    const logical = this.#logical;
    if (this.#d.isClosed()) throw new NixlError('push receiver is closed', 'NIXL_ERR_NOT_ALLOWED');
    if (!isNotifId(requestId))
      throw new NixlError(
        `request id ${JSON.stringify(requestId.slice(0, 80))} cannot be used in a notification`,
        'NIXL_ERR_INVALID_PARAM',
      );
    if (this.#d.waits.busy(requestId))
      throw new NixlError(
        `request '${requestId}' is already receiving, or failed and its WRITEs may still come: use a new id`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    const l = this.#d.o.layout;
    const r = l.physicalBlocksPerLogical ?? 1;
    if (logical.length === 0) throw new NixlError('no local blocks to register', 'NIXL_ERR_INVALID_PARAM');
    if (logical.some((b) => !Number.isInteger(b) || b < 0 || (b + 1) * r > l.numBlocks))
      throw new NixlError(
        `local block ids must be logical ids below ${Math.floor(l.numBlocks / r)}`,
        'NIXL_ERR_INVALID_PARAM',
      );
    if (new Set(logical).size !== logical.length)
      throw new NixlError('local block ids repeat', 'NIXL_ERR_INVALID_PARAM');
    const busy = logical.filter((b) => this.#d.inUse.has(b));
    if (busy.length)
      throw new NixlError(
        `local blocks ${busy.slice(0, 8).join(', ')} are being received into`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    const q = this.#d.quarantine;
    const held = q.held(kernelIds(l.physicalBlocksPerLogical ?? 1, logical));
    if (held.length)
      throw new NixlError(
        `local blocks ${held.slice(0, 8).join(', ')} are in quarantine: a prefill may still WRITE into them (until ${q.until(held[0])!.toFixed(0)} ms)`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    checkRemoteSizes(l, { tpSize: p.tpSize, ppSize: p.ppSize }, { ...DEFAULT_LIMITS, ...this.#d.o.limits });
  }

  /** handshake: the prefill's agents (notif-only), by the deadline. */
  async #handshake(ep: RemoteEndpoint, deadline: number): Promise<RemoteEngine> {
    const attempt = this.#d.engines.attempt(ep);
    this.#attempt = attempt;
    const engine = await this.#as(
      (e) => this.#common(e) ?? byCode(e),
      () => withDeadline(attempt.promise, deadline, this.#r.signal),
    );
    this.#engine = engine;
    return engine;
  }

  /**
   * register: listens for the WRITEs first (a fast prefill's notification
   * must find us waiting), then sends the registration to every prefill
   * agent handshaked; one that cannot be reached fails the request.
   */
  #register(engine: RemoteEngine, p: PushParams, deadline: number): { w: Waiting; written: Promise<Waiting> } {
    return this.#as(
      (e) => this.#common(e) ?? byCode(e),
      () => {
        const { requestId, signal } = this.#r;
        const expected = expectedWrites(p.ppSize, p.tpSize, this.#d.o.layout.tpSize);
        const waiting = this.#d.waits.wait(
          requestId,
          new Set(engine.agentNames()),
          expected,
          p.tpSize,
          deadline,
          signal,
        );
        // Awaited in the wait stage; when the registration fails first, run()'s finally ends the wait.
        waiting.written.catch(() => undefined);
        this.#registered = true;
        this.#send(engine, p, deadline);
        return waiting;
      },
    );
  }

  #send(engine: RemoteEngine, p: PushParams, deadline: number): void {
    const { o } = this.#d;
    const l = o.layout;
    const { requestId } = this.#r;
    const msg = encodePushReg(
      {
        requestId,
        decodeEngineId: l.engineId,
        decodeHost: o.decodeHost,
        decodePort: o.decodePort,
        decodeTpSize: l.tpSize,
        localBlockIds: [this.#logical],
        remoteEngineId: p.remoteEngineId,
        remoteHost: p.remoteHost,
        remotePort: p.remotePort,
        remoteTpSize: p.tpSize,
        remotePpSize: p.ppSize,
        confirm: true,
        // Less a slack for the notification's transit: the prefill counts from receipt.
        deadlineMs: Math.max(0, Math.floor(deadline - performance.now() - DEADLINE_SLACK_MS)),
        sentAtMs: Date.now(),
      },
      o.secret,
    );
    for (const name of engine.agentNames())
      if (!this.#d.send(name, msg))
        throw new NixlError(
          `the registration of '${requestId}' could not be sent to prefill agent '${name}'`,
          'NIXL_ERR_REMOTE_DISCONNECT',
        );
  }

  /** wait: every WRITE notification; a failure has the kind the wait saw (write-waits.ts). */
  async #wait(w: Waiting, written: Promise<Waiting>): Promise<void> {
    await this.#as(
      (e) => this.#common(e) ?? w.failedAs ?? 'handshake',
      () => written,
    );
  }

  /**
   * Heartbeats to the prefill's agents soon after the registration (100 ms,
   * doubling up to the heartbeat interval), which extend its lease as the
   * periodic ones do. A prefill that could not connect back to us leaves our
   * endpoint to it failed and will never WRITE: a send then fails the receive
   * at once (WriteWaits.unreachable), not at its deadline.
   */
  #probe(engine: RemoteEngine, remoteRequestId: string): () => void {
    if (!this.#d.wire.heartbeats) return () => {};
    const every = Math.floor(this.#d.leaseMs / 6);
    let delay = PROBE_FIRST_MS;
    let t: NodeJS.Timeout | undefined;
    const tick = () => {
      for (const name of engine.agentNames()) this.#d.send(name, `HB:${remoteRequestId}`);
      delay *= 2;
      if (delay < every) t = setTimeout(tick, delay);
    };
    t = setTimeout(tick, delay);
    return () => clearTimeout(t);
  }

  /** A prefill that took no registration (gone, or restarted as new agents) is handshaked afresh next time. */
  #failed(e: unknown): PushError {
    const err = e instanceof PushError ? e : this.#fail('setup', e);
    // NIXL takes a notification to a gone agent without an error, so a timeout may mean the same; but a full
    // connection (KvPeers: another role's, with reads planned) is dropped only when the prefill is gone for sure.
    const engine = this.#engine;
    if (engine && (err.kind === 'peer-gone' || (err.kind === 'timeout' && engine.reads.length === 0)))
      this.#d.engines.forget(engine, this.#attempt?.promise);
    if (!this.#registered) return err;
    const d = this.#d;
    const until = performance.now() + (d.o.quarantineMs ?? d.leaseMs + 5000);
    d.quarantine.add(this.#r.requestId, kernelIds(d.o.layout.physicalBlocksPerLogical ?? 1, this.#logical), until);
    d.waits.gaveUp(this.#r.requestId, until + 10 * d.leaseMs);
    return this.#fail(err.kind, err.cause, until);
  }
}

/** Kernel block ids of logical ones. @internal */
export function kernelIds(perLogical: number, logical: number[]): number[] {
  return logical.flatMap((b) => Array.from({ length: perLogical }, (_, j) => b * perLogical + j));
}

function flatIds(ids: ArrayLike<number> | ArrayLike<number>[]): number[] {
  const a = Array.from(ids as ArrayLike<number | ArrayLike<number>>);
  if (a.length > 0 && typeof a[0] !== 'number') {
    if (a.length !== 1)
      throw new NixlError(`${a.length} KV-cache groups: nixl-node pushes one group`, 'NIXL_ERR_NOT_SUPPORTED');
    return Array.from(a[0] as ArrayLike<number>);
  }
  return a as number[];
}

function withDeadline<T>(p: Promise<T>, deadline: number, signal?: AbortSignal): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const t = setTimeout(
      () => reject(new NixlError('the handshake with the prefill did not end before the deadline', 'NIXL_ERR_TIMEOUT')),
      Math.max(0, deadline - performance.now()),
    );
    const onAbort = () => reject(new NixlError('receive aborted', 'NIXL_ERR_CANCELED'));
    signal?.addEventListener('abort', onAbort, { once: true });
    p.then(resolve, reject).finally(() => {
      clearTimeout(t);
      signal?.removeEventListener('abort', onAbort);
    });
  });
}
