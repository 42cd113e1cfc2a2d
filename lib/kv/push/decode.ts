// The decode side of push mode (vLLM's NixlPushConnector as the consumer):
// handshake notif-only with the prefill ranks this rank maps to, send each
// the PUSH_REG naming our blocks, keep the prefill's lease alive with
// heartbeats, and count the WRITE notifications "<our id>:<prefill TP>" up
// to pp_size x max(1, P_tp // D_tp) (vLLM's push worker).
//
// It fails closed, unlike vLLM (whose decode waits forever): each request has
// its own deadline, and a request that has not received every WRITE by then
// fails with a PushError. A block it registered cannot be known free of
// WRITEs then, so it goes into quarantine (push-quarantine.ts) until the
// prefill's lease is over, and receive() refuses quarantined blocks. A
// nixl-node prefill is also told the deadline (nixl_node_deadline_ms, a key
// vLLM ignores) and posts nothing after it.
import type { NixlAgent, Notif } from '../../agent';
import { NixlError } from '../../errors';
import { createHandshake } from '../../handshake';
import type { WireName, WireProfile } from '../../handshake/model';
import type { HandshakeMethod, HandshakeStrategy, TlsClientOptions } from '../../handshake/types';
import { wireProfile } from '../../handshake/wire';
import { type RemoteEndpoint, engineKey } from '../engine-connect';
import { checkLayout, type KvLayout } from '../layout';
import { LeaseKeeper } from '../leases';
import { DEFAULT_LIMITS, type PullLimits, checkRemoteSizes } from '../limits';
import { LocalDlists } from '../local-dlists';
import { BlockQuarantine } from './quarantine';
import {
  PUSH_REFUSED_PREFIX,
  type PushParams,
  decodeRefusal,
  encodePushReg,
  expectedWrites,
  isNotifId,
  parsePushParams,
} from './reg';
import { PushError, type PushFailure, type PushReceived, type ReceiveOptions } from './types';
import { type RemoteEngine, RemoteEngines } from '../remote-engines';
import { ucxErrorMode, ucxModeHint } from '../../ucx';

/** Options of a KvPushReceiver. */
export interface KvPushReceiverOptions {
  agent: NixlAgent;
  /** This decode rank's KV cache (its engineId is the decode_engine_id prefills check). */
  layout: KvLayout;
  /** Where prefills reach this decode's side channel (PUSH_REG decode_host / decode_port). */
  decodeHost: string;
  decodePort: number;
  handshake?: HandshakeStrategy | HandshakeMethod;
  /** Default: NIXL_WIRE, else v12 (push needs v12). */
  wire?: WireName | WireProfile;
  /** The push compatibility hash (transferMode 'push'); undefined skips the check. */
  expectedHash?: string;
  /** The prefill's kv_lease_duration: heartbeats every sixth of it, and the quarantine's base. Default 30 s. */
  kvLeaseMs?: number;
  /** Default deadline of a receive, ms. Default 120 s. */
  timeoutMs?: number;
  /** How long a block given up on stays out of use. Default kvLeaseMs + 5 s. */
  quarantineMs?: number;
  /** Sign registrations with this KV secret (the prefill must hold the same one). */
  secret?: string | Buffer;
  limits?: PullLimits;
  handshakeTimeoutMs?: number;
  tls?: TlsClientOptions;
  bearerToken?: string;
}

interface Waiting {
  requestId: string;
  /** The prefill agents registered with: only their notifications count. */
  agents: ReadonlySet<string>;
  expected: number;
  prefillTp: number;
  count: number;
  from: Set<string>;
  done(err?: NixlError): void;
}

const WRITE_NOTIF = /^(.+):(\d+)$/s;
/** The first probe of the prefill's agents after a registration, ms (then doubling; see #probe). */
const PROBE_FIRST_MS = 100;
/** What the deadline a nixl-node prefill is told falls short of ours, ms (covers the registration's transit). */
const DEADLINE_SLACK_MS = 50;

/** The decode side of push mode: registers blocks with a prefill and proves every WRITE arrived. */
export class KvPushReceiver {
  readonly quarantine = new BlockQuarantine();
  readonly #o: KvPushReceiverOptions;
  readonly #wire: WireProfile;
  readonly #hs: HandshakeStrategy;
  readonly #engines: RemoteEngines;
  readonly #leases: LeaseKeeper<RemoteEndpoint, RemoteEngine>;
  readonly #waiting = new Map<string, Waiting>();
  /** Local blocks of receives in flight. */
  readonly #inUse = new Set<number>();
  /** Ids given up on, until when a WRITE notification for them is expected as late. */
  readonly #gaveUp = new Map<string, number>();
  readonly #abort = new AbortController();
  #loop: Promise<void> | undefined;
  #closed = false;
  /** WRITE notifications for a request after it failed (its blocks were in quarantine). */
  lateWrites = 0;
  /** Notifications naming no receive of ours. */
  unrecognized = 0;

  constructor(o: KvPushReceiverOptions) {
    checkLayout(o.layout);
    if (typeof o.decodeHost !== 'string' || o.decodeHost.length === 0 || o.decodeHost.length > 256)
      throw new NixlError('decodeHost must be a host name of 1..256 characters', 'NIXL_ERR_INVALID_PARAM');
    if (!Number.isInteger(o.decodePort) || o.decodePort < 1 || o.decodePort > 65535)
      throw new NixlError(`decodePort must be a port, got ${o.decodePort}`, 'NIXL_ERR_INVALID_PARAM');
    this.#o = o;
    this.#wire = wireProfile(o.wire);
    if (!this.#wire.transferModes.includes('push'))
      throw new NixlError(
        `push mode is not part of the ${this.#wire.name} wire format (use v12)`,
        'NIXL_ERR_NOT_SUPPORTED',
      );
    this.#hs = typeof o.handshake === 'object' ? o.handshake : createHandshake(o.handshake);
    const limits = { ...DEFAULT_LIMITS, ...o.limits };
    this.#engines = new RemoteEngines({
      ...o,
      handshake: this.#hs,
      wire: this.#wire,
      limits,
      local: new LocalDlists(o.agent, o.layout),
      notifOnly: true,
      leaseBoards: false,
    });
    this.#leases = new LeaseKeeper({
      wire: this.#wire,
      kvLeaseMs: o.kvLeaseMs,
      keyOf: engineKey,
      engineFor: (ep) => this.#engines.get(ep),
      notify: (name, msg) => this.#send(name, msg),
    });
  }

  get #leaseMs(): number {
    return this.#o.kvLeaseMs ?? this.#wire.defaultLeaseMs;
  }

  /** Heartbeats sent so far. */
  get heartbeatsSent(): number {
    return this.#leases.heartbeatsSent;
  }

  /**
   * Registers `localBlockIds` (our logical ids, one KV-cache group) with the
   * prefill the params name and resolves once every WRITE notification came;
   * PushError otherwise, by the deadline at the latest.
   */
  async receive(params: PushParams | Record<string, unknown>, opts: ReceiveOptions): Promise<PushReceived> {
    const t0 = performance.now();
    const timeoutMs = opts.timeoutMs ?? this.#o.timeoutMs ?? 120_000;
    const deadline = t0 + timeoutMs;
    let logical: number[] = [];
    const fail = (kind: PushFailure, e: unknown, quarantinedUntil?: number) =>
      PushError.of(kind, e, opts.requestId, logical, quarantinedUntil);
    let p: PushParams;
    try {
      logical = flatIds(opts.localBlockIds);
      // A timer holds at most 2^31-1 ms (Node fires a longer one at once), and the registration carries it.
      if (!Number.isInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > 2 ** 31 - 1)
        throw new NixlError(`timeoutMs must be an integer in 1..2^31-1, got ${timeoutMs}`, 'NIXL_ERR_INVALID_PARAM');
      p = 'remoteEngineId' in params ? (params as PushParams) : parsePushParams(params);
      this.#admit(opts.requestId, logical, p);
    } catch (e) {
      throw fail('setup', e);
    }
    const ep: RemoteEndpoint = {
      host: p.remoteHost,
      port: p.remotePort,
      tpSize: p.tpSize,
      ppSize: p.ppSize,
      engineId: p.remoteEngineId,
    };
    const release = this.#leases.hold(ep, p.remoteRequestId);
    for (const b of logical) this.#inUse.add(b);
    let registered = false;
    const attempt = this.#engines.attempt(ep);
    let engine: RemoteEngine | undefined;
    let stopProbe = () => {};
    try {
      engine = await this.#withDeadline(attempt.promise, deadline, opts.signal);
      const expected = expectedWrites(p.ppSize, p.tpSize, this.#o.layout.tpSize);
      const agents = new Set(engine.agentNames());
      const waiting = this.#wait(opts.requestId, agents, expected, p.tpSize, deadline, opts.signal);
      // Awaited below; when the registration fails first, the catch reports it and finally ends the wait.
      waiting.catch(() => undefined);
      registered = true;
      this.#register(engine, opts.requestId, logical, p, deadline);
      stopProbe = this.#probe(engine, p.remoteRequestId);
      const w = await waiting;
      return {
        requestId: opts.requestId,
        notifications: w.count,
        writers: [...w.from],
        waitedMs: performance.now() - t0,
      };
    } catch (e) {
      const kind = kindOf(e, opts.signal);
      // A prefill that took no registration (gone, or restarted as new agents): handshake afresh next time.
      // NIXL takes a notification to a gone agent without an error, so a timeout may mean the same.
      if (engine && (kind === 'peer-gone' || kind === 'timeout')) this.#engines.forget(engine, attempt.promise);
      if (!registered) throw fail(kind, e);
      const until = performance.now() + (this.#o.quarantineMs ?? this.#leaseMs + 5000);
      this.quarantine.add(opts.requestId, this.#kernelIds(logical), until);
      this.#gaveUp.set(opts.requestId, until + 10 * this.#leaseMs);
      throw fail(kind, e, until);
    } finally {
      stopProbe();
      release();
      this.#waiting.get(opts.requestId)?.done(new NixlError('receive ended', 'NIXL_ERR_CANCELED'));
      this.#waiting.delete(opts.requestId);
      for (const b of logical) this.#inUse.delete(b);
    }
  }

  /** The request may start: open, a usable id, blocks in range, not in use, not in quarantine. */
  #admit(requestId: string, logical: number[], p: PushParams): void {
    if (this.#closed) throw new NixlError('push receiver is closed', 'NIXL_ERR_NOT_ALLOWED');
    if (!isNotifId(requestId))
      throw new NixlError(
        `request id ${JSON.stringify(requestId.slice(0, 80))} cannot be used in a notification`,
        'NIXL_ERR_INVALID_PARAM',
      );
    this.#forgetGaveUp();
    const gone = this.#gaveUp.get(requestId);
    if (this.#waiting.has(requestId) || gone !== undefined)
      throw new NixlError(
        `request '${requestId}' is already receiving, or failed and its WRITEs may still come: use a new id`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    const l = this.#o.layout;
    const r = l.physicalBlocksPerLogical ?? 1;
    if (logical.length === 0) throw new NixlError('no local blocks to register', 'NIXL_ERR_INVALID_PARAM');
    if (logical.some((b) => !Number.isInteger(b) || b < 0 || (b + 1) * r > l.numBlocks))
      throw new NixlError(
        `local block ids must be logical ids below ${Math.floor(l.numBlocks / r)}`,
        'NIXL_ERR_INVALID_PARAM',
      );
    if (new Set(logical).size !== logical.length)
      throw new NixlError('local block ids repeat', 'NIXL_ERR_INVALID_PARAM');
    const busy = logical.filter((b) => this.#inUse.has(b));
    if (busy.length)
      throw new NixlError(
        `local blocks ${busy.slice(0, 8).join(', ')} are being received into`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    const held = this.quarantine.held(this.#kernelIds(logical));
    if (held.length)
      throw new NixlError(
        `local blocks ${held.slice(0, 8).join(', ')} are in quarantine: a prefill may still WRITE into them (until ${this.quarantine.until(held[0])!.toFixed(0)} ms)`,
        'NIXL_ERR_NOT_ALLOWED',
      );
    checkRemoteSizes(l, { tpSize: p.tpSize, ppSize: p.ppSize }, { ...DEFAULT_LIMITS, ...this.#o.limits });
  }

  /** Ids given up on whose WRITEs can no longer come (each receive and late WRITE prunes: bounded by failures in that window). */
  #forgetGaveUp(): void {
    const now = performance.now();
    for (const [k, until] of this.#gaveUp) if (until <= now) this.#gaveUp.delete(k);
  }

  #kernelIds(logical: number[]): number[] {
    const r = this.#o.layout.physicalBlocksPerLogical ?? 1;
    return logical.flatMap((b) => Array.from({ length: r }, (_, j) => b * r + j));
  }

  /** Sends the registration to every prefill agent handshaked; a rank that refuses it fails the request. */
  #register(engine: RemoteEngine, requestId: string, logical: number[], p: PushParams, deadline: number): void {
    const l = this.#o.layout;
    const msg = encodePushReg(
      {
        requestId,
        decodeEngineId: l.engineId,
        decodeHost: this.#o.decodeHost,
        decodePort: this.#o.decodePort,
        decodeTpSize: l.tpSize,
        localBlockIds: [logical],
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
      this.#o.secret,
    );
    for (const name of engine.agentNames())
      if (!this.#send(name, msg))
        throw new NixlError(
          `the registration of '${requestId}' could not be sent to prefill agent '${name}'`,
          'NIXL_ERR_REMOTE_DISCONNECT',
        );
  }

  /** Waits for `expected` WRITE notifications of `requestId` (one posting: this call's). */
  #wait(
    requestId: string,
    agents: ReadonlySet<string>,
    expected: number,
    prefillTp: number,
    deadline: number,
    signal?: AbortSignal,
  ): Promise<Waiting> {
    this.#start();
    return new Promise<Waiting>((resolve, reject) => {
      const w: Waiting = {
        requestId,
        agents,
        expected,
        prefillTp,
        count: 0,
        from: new Set(),
        done: (err) => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
          if (this.#waiting.get(requestId) === w) this.#waiting.delete(requestId);
          if (err) reject(err);
          else resolve(w);
        },
      };
      const timer = setTimeout(
        () =>
          w.done(
            new NixlError(`${w.count} of ${expected} WRITE notifications came before the deadline`, 'NIXL_ERR_TIMEOUT'),
          ),
        Math.max(0, deadline - performance.now()),
      );
      const onAbort = () => w.done(new NixlError('receive aborted', 'NIXL_ERR_CANCELED'));
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      this.#waiting.set(requestId, w);
    });
  }

  #start(): void {
    if (this.#loop) return;
    this.#loop = (async () => {
      while (!this.#abort.signal.aborted) {
        let n: Notif;
        try {
          n = await this.#o.agent.waitForNotif((x) => this.#mine(x), { signal: this.#abort.signal });
        } catch {
          return;
        }
        this.#onWrite(n);
      }
    })();
  }

  #mine(n: Notif): boolean {
    const msg = n.msg.toString('utf8');
    const id = msg.startsWith(PUSH_REFUSED_PREFIX) ? decodeRefusal(msg)?.requestId : WRITE_NOTIF.exec(msg)?.[1];
    return id !== undefined && (this.#waiting.has(id) || this.#gaveUp.has(id));
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
    w.done(e);
  }

  #onWrite(n: Notif): void {
    const msg = n.msg.toString('utf8');
    if (msg.startsWith(PUSH_REFUSED_PREFIX)) {
      this.#onRefusal(n, msg);
      return;
    }
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
        new NixlError(
          `a WRITE notification says prefill TP ${suffix}, the params said ${w.prefillTp}: not counted, request failed`,
          'NIXL_ERR_MISMATCH',
        ),
      );
      return;
    }
    if (w.from.has(n.agent)) {
      // Each prefill rank WRITEs once per decode rank: a second one is another push into our blocks.
      w.done(
        new NixlError(
          `a second WRITE notification from prefill agent '${n.agent}': which WRITE landed last is unknown, request failed`,
          'NIXL_ERR_MISMATCH',
        ),
      );
      return;
    }
    w.count++;
    w.from.add(n.agent);
    if (w.count >= w.expected) w.done();
  }

  #withDeadline<T>(p: Promise<T>, deadline: number, signal?: AbortSignal): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const t = setTimeout(
        () =>
          reject(new NixlError('the handshake with the prefill did not end before the deadline', 'NIXL_ERR_TIMEOUT')),
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

  #send(agentName: string, msg: string | Buffer): boolean {
    try {
      this.#o.agent.sendNotif(agentName, msg);
      return true;
    } catch (e) {
      if ((e as NixlError).code === 'NIXL_ERR_REMOTE_DISCONNECT') this.#unreachable(agentName, e as NixlError);
      return false;
    }
  }

  /**
   * Heartbeats to the prefill's agents soon after the registration (100 ms,
   * doubling up to the heartbeat interval), which extend its lease as the
   * periodic ones do. A prefill that could not connect back to us leaves our
   * endpoint to it failed and will never WRITE: a send then fails the receive
   * at once (#unreachable), not at its deadline.
   */
  #probe(engine: RemoteEngine, remoteRequestId: string): () => void {
    if (!this.#wire.heartbeats) return () => {};
    const every = Math.floor(this.#leaseMs / 6);
    let delay = PROBE_FIRST_MS;
    let t: NodeJS.Timeout | undefined;
    const tick = () => {
      for (const name of engine.agentNames()) this.#send(name, `HB:${remoteRequestId}`);
      delay *= 2;
      if (delay < every) t = setTimeout(tick, delay);
    };
    t = setTimeout(tick, delay);
    return () => clearTimeout(t);
  }

  /** A prefill agent our sends no longer reach: the receives waiting on it fail now. */
  #unreachable(agentName: string, e: NixlError): void {
    for (const w of [...this.#waiting.values()])
      if (w.agents.has(agentName))
        w.done(
          new NixlError(
            `prefill agent '${agentName}' cannot be reached since the registration (${e.message}): it is gone, or it ` +
              `could not connect back to this agent; ${ucxModeHint(ucxErrorMode(this.#o.agent))}`,
            'NIXL_ERR_REMOTE_DISCONNECT',
            undefined,
            { cause: e },
          ),
        );
  }

  /** What the receiver holds right now (tests check nothing leaks). */
  resources(): { receiving: number; gaveUp: number; quarantined: number; engines: number; remoteAgents: number } {
    return {
      receiving: this.#waiting.size,
      gaveUp: this.#gaveUp.size,
      quarantined: this.quarantine.size,
      engines: this.#engines.size,
      remoteAgents: this.#engines.remoteAgents,
    };
  }

  /** Stops: receives in flight fail (their blocks go into quarantine). */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const w of [...this.#waiting.values()]) w.done(new NixlError('push receiver closed', 'NIXL_ERR_CANCELED'));
    this.#abort.abort();
    await this.#loop;
    this.#leases.close();
    await this.#engines.close();
    this.quarantine.close();
    this.#hs.close();
  }
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

function kindOf(e: unknown, signal?: AbortSignal): PushFailure {
  const code = (e as NixlError)?.code;
  if (signal?.aborted || code === 'NIXL_ERR_CANCELED') return 'aborted';
  if ((e as Error).name === 'PushRefused') return 'refused';
  if (code === 'NIXL_ERR_TIMEOUT') return 'timeout';
  if (code === 'NIXL_ERR_REMOTE_DISCONNECT') return 'peer-gone';
  if (code === 'NIXL_ERR_MISMATCH' && (e as Error).name !== 'TransferModeError') return 'mismatch';
  return 'handshake';
}
