// Push mode in a worker (vLLM's NixlPushConnector, docs/kv-push.md): a
// decode registers the blocks it allocated with the prefill its
// kv_transfer_params name (KvPushReceiver) and decodes once every WRITE came;
// a prefill offers the blocks it filled (KvPushSender) and holds them until
// they are written or its lease ends. A worker serves one mode, as a vLLM
// engine does: the side channel's compatibility hash says which.
import { randomBytes } from 'node:crypto';
import type { NixlAgent } from '../../agent';
import type { WireName } from '../../handshake/model';
import { buildKvTransferParams } from '../../handshake/wire';
import type { KvLayout } from '../../kv/layout';
import type { KvStats } from '../../kv/stats';
import { KvPushReceiver } from '../../kv/push/decode';
import { KvPushSender, type PushSent } from '../../kv/push/prefill';
import { baseRequestId, isNotifId, parsePushParams, type PushParams } from '../../kv/push/reg';
import { PushError, type PushReceived } from '../../kv/push/types';
import { HttpError } from '../api/http';
import type { KvBinding } from '../models/types';

/** How a worker moves KV: the decode reads it (pull) or the prefill writes it (push). */
export type KvMode = 'pull' | 'push';

export interface PushServingOptions {
  agent: NixlAgent;
  layout: KvLayout;
  /** The push compatibility hash (pushHash of the model's). */
  hash: string;
  /** This worker's side channel: prefills handshake back to it to WRITE. */
  host: string;
  port: number;
  wire?: WireName;
  leaseMs?: number;
  /** A decode's deadline for every WRITE, ms (default 30 s). */
  receiveTimeoutMs?: number;
  secret?: string;
  /** Where the prefill's WRITEs are counted (the worker's transfer stats, behind vllm:nixl_*). */
  transferStats?: KvStats;
}

/** A push worker's side-channel hash: the model's, marked push (a pull peer is refused at the handshake). */
export function pushHash(modelHash: string): string {
  return `${modelHash};transfer_mode=push`;
}

/**
 * The request a pushed state is bound to, the same on both sides: the
 * prefill's engine and the transfer id (the base of both sides' ids). The
 * decode sized its blocks from its own prompt, so the state must be of it.
 */
export function pushBinding(prefillEngineId: string, id: string): KvBinding {
  return { engineId: prefillEngineId, requestId: baseRequestId(id), blockIds: [], ownPrompt: true };
}

/** The worker's push sides: a receiver for its decodes, a sender for its prefills. */
export class PushServing {
  readonly receiver: KvPushReceiver;
  readonly sender: KvPushSender;
  readonly #o: PushServingOptions;
  /** Blocks given up on, going back to the pool when no WRITE can land any more. */
  readonly #timers = new Set<NodeJS.Timeout>();

  constructor(o: PushServingOptions) {
    this.#o = o;
    const common = { agent: o.agent, layout: o.layout, expectedHash: o.hash, wire: o.wire, secret: o.secret };
    this.receiver = new KvPushReceiver({
      ...common,
      decodeHost: o.host,
      decodePort: o.port,
      kvLeaseMs: o.leaseMs,
      timeoutMs: o.receiveTimeoutMs ?? 30_000,
    });
    this.sender = new KvPushSender({
      ...common,
      leaseMs: o.leaseMs,
      logger: { warn() {} } as never,
      transferStats: o.transferStats,
    });
  }

  /**
   * The id a prefill offers its blocks under: the proxy's transfer_id (what
   * the decode's registration names too) with a suffix of its own, paired by
   * base id as vLLM pairs; never made of anything else the client sent.
   */
  static offerId(kvp: Record<string, unknown>): string {
    return `${transferId(kvp)}-${randomBytes(4).toString('hex')}`;
  }

  /** The kv_transfer_params a push prefill answers with (vLLM's push scheduler's). */
  params(o: { engineId: string; requestId: string; host: string; port: number; tokens: number }) {
    return buildKvTransferParams(
      {
        remoteBlockIds: [[]],
        remoteEngineId: o.engineId,
        remoteRequestId: o.requestId,
        remoteHost: o.host,
        remotePort: o.port,
        tpSize: 1,
        ppSize: 1,
        remoteNumTokens: o.tokens,
        transferMode: 'push',
      },
      this.#o.wire,
    );
  }

  /**
   * Offers a prefilled request's blocks; settles when written, aborted,
   * failed or at the lease. `whole`: only a decode that registered exactly
   * as many blocks is written.
   */
  offer(id: string, ids: number[], whole = false): Promise<PushSent> {
    return this.sender.offer(id, ids, { exactBlocks: whole });
  }

  /**
   * Registers `ids` with the prefill the params name and waits for every
   * WRITE. A failure is an HttpError; `give` is called (the blocks go back)
   * at once when nothing was registered, else once no WRITE can land.
   */
  async receive(
    kvp: Record<string, unknown>,
    ids: number[],
    signal: AbortSignal,
    give: () => void,
  ): Promise<{ params: PushParams; got: PushReceived }> {
    let params: PushParams;
    try {
      params = parsePushParams(kvp);
      transferId(kvp);
    } catch (e) {
      give();
      throw new HttpError(400, `kv_transfer_params: ${(e as Error).message}`, (e as { code?: string }).code);
    }
    try {
      const requestId = `${transferId(kvp)}-${randomBytes(4).toString('hex')}`;
      const got = await this.receiver.receive(params, { requestId, localBlockIds: ids, signal });
      return { params, got };
    } catch (e) {
      const err = e as PushError;
      const until = err instanceof PushError ? err.quarantinedUntilMs : undefined;
      if (until === undefined) give();
      else {
        const t = setTimeout(
          () => {
            this.#timers.delete(t);
            give();
          },
          Math.max(0, until - performance.now()),
        );
        t.unref();
        this.#timers.add(t);
      }
      throw pushHttpError(err, signal);
    }
  }

  /** Blocks of failed receives still waiting out their quarantine. */
  get quarantined(): number {
    return this.#timers.size;
  }

  async close(): Promise<void> {
    for (const t of this.#timers) clearTimeout(t);
    this.#timers.clear();
    await this.receiver.close();
    await this.sender.close();
  }
}

/** The proxy's transfer_id, else the remote_request_id: the id both legs of one request share. */
function transferId(kvp: Record<string, unknown>): string {
  const t = kvp.transfer_id ?? kvp.remote_request_id;
  if (typeof t !== 'string' || t.length < 1 || t.length > 200 || !isNotifId(t))
    throw new HttpError(
      400,
      "push kv_transfer_params need a 'transfer_id' (or remote_request_id) usable in a notification",
    );
  return t;
}

function pushHttpError(e: unknown, signal: AbortSignal): HttpError {
  if (!(e instanceof PushError))
    return e instanceof HttpError ? e : new HttpError(502, String((e as Error)?.message ?? e));
  if (e.kind === 'aborted' || signal.aborted) return new HttpError(499, e.message, 'aborted');
  if (e.kind === 'timeout') return new HttpError(504, `KV push failed (timeout): ${e.message}`, 'kv_push_timeout');
  if (e.kind === 'setup') return new HttpError(400, `KV push failed (setup): ${e.message}`, e.code);
  if (e.kind === 'refused')
    return new HttpError(502, `KV push failed (refused by the prefill): ${e.message}`, 'kv_push_refused', {
      nixl_code: e.code,
    });
  return new HttpError(502, `KV push failed (${e.kind}): ${e.message}`, e.code);
}
