// Push mode in a worker (vLLM's NixlPushConnector, docs/kv-push.md): a
// decode registers the blocks it allocated with the prefill its
// kv_transfer_params name (KvPushReceiver) and decodes once every WRITE came;
// a prefill offers the blocks it filled (KvPushSender) and holds them until
// they are written or its lease ends. A worker serves one mode, as a vLLM
// engine does: the side channel's compatibility hash says which. The only
// file of the worker that knows what push is.
import { randomBytes } from 'node:crypto';
import { NixlError } from '../../errors';
import { buildKvTransferParams } from '../../handshake/wire';
import { KvPushReceiver } from '../../kv/push/decode';
import { KvPushSender } from '../../kv/push/prefill';
import { baseRequestId, isNotifId, parsePushParams, type PushParams } from '../../kv/push/reg';
import { PushError } from '../../kv/push/types';
import { failure } from '../api/errors';
import { type GenerationRequest, type KvBinding, KvRejected, type PrefilledKv } from '../models/types';
import type { Taken } from './block-store';
import { badParams, pushFailure } from './failures';
import type {
  DecodePlan,
  FetchContext,
  Fetched,
  HandoffOptions,
  KvHandoff,
  KvMode,
  KvRoute,
  PullMode,
  SideChannelOptions,
} from './handoff';
import type { Hold } from './holds';
import type { ReleaseReason } from './stats';
import { stall } from './test-hooks';

/** Whether kv_transfer_params ask for push (a pull worker refuses them). */
export function asksForPush(kvp: Record<string, unknown> | undefined): boolean {
  return kvp?.transfer_mode === 'push';
}

/** The worker's KV mode: push, or the pull it is given. */
export function handoffFor(mode: KvMode | undefined, o: HandoffOptions, pull: PullMode): KvHandoff {
  return mode === 'push' ? new PushHandoff(o, pull) : pull;
}

/**
 * A push worker serves push only, and push never reads a held turn: a
 * decode would evaluate and save every turn again for nobody (vLLM refuses
 * the pair at startup too, #46473).
 */
export function checkKvMode(o: { kvMode?: KvMode; bidirectionalKv?: boolean }): void {
  if (o.bidirectionalKv && o.kvMode === 'push')
    throw new NixlError(
      'bidirectional KV (multi-turn) goes with pull mode only: push never reads a held turn (vLLM refuses it too)',
      'NIXL_ERR_NOT_SUPPORTED',
    );
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

/**
 * Push: the worker's KV mode. A request's params that say pull go the pull
 * way (its tracker and puller); any other is pushed.
 */
export class PushHandoff implements KvHandoff, KvRoute {
  #receiver?: KvPushReceiver;
  #sender?: KvPushSender;
  /** Blocks given up on, going back to the pool when no WRITE can land any more. */
  readonly #timers = new Set<NodeJS.Timeout>();

  constructor(
    readonly o: HandoffOptions,
    readonly pull: PullMode,
  ) {}

  /** The side channel (prefills handshake back to it to WRITE), then the receiver and sender. */
  async start(so: SideChannelOptions): Promise<void> {
    await this.pull.start({ ...so, hash: pushHash(this.o.model.compatibilityHash) });
    const side = this.pull.side!;
    const o = this.o;
    const common = {
      agent: o.agent,
      layout: o.layout,
      peers: o.peers,
      expectedHash: pushHash(o.model.compatibilityHash),
      wire: o.wire,
      secret: o.secret,
    };
    this.#receiver = new KvPushReceiver({
      ...common,
      decodeHost: side.host,
      decodePort: side.basePort,
      kvLeaseMs: o.leaseMs,
      timeoutMs: o.pushTimeoutMs ?? 30_000,
    });
    this.#sender = new KvPushSender({
      ...common,
      leaseMs: o.leaseMs,
      logger: { warn() {} } as never,
      transferStats: this.pull.puller.stats,
    });
  }

  pick(kvp: Record<string, unknown> | undefined): KvRoute {
    return kvp === undefined || asksForPush(kvp) || kvp.transfer_mode === undefined ? this : this.pull;
  }

  /** What a push proxy sends a decode up front: where this worker's KV is (vLLM DEMO1's --prefill-* flags). */
  health(): Record<string, unknown> {
    const side = this.pull.side;
    if (!side) return { kv_mode: 'push' };
    return {
      kv_mode: 'push',
      kv_engine_id: this.o.name,
      kv_host: side.host,
      kv_port: side.basePort,
      tp_size: 1,
      pp_size: 1,
    };
  }

  // ---- prefill ----

  /** A prompt its decode cannot size is refused here as the decode refuses it, before any compute. */
  checkPrefill(req: GenerationRequest): void {
    if (this.o.model.pushBlocksFor) this.#blocksFor(req);
  }

  /**
   * The id a prefill offers its blocks under: the proxy's transfer_id (what
   * the decode's registration names too) with a suffix of its own, paired by
   * base id as vLLM pairs; never made of anything else the client sent.
   */
  holdId(kvp: Record<string, unknown>): string {
    return `${transferId(kvp)}-${randomBytes(4).toString('hex')}`;
  }

  checkKv(kv: PrefilledKv): void {
    if (kv.unpushable) throw failure('kv_push_unsized', `this prefill's KV cannot be pushed: ${kv.unpushable}`);
  }

  binding(holdId: string): KvBinding {
    return pushBinding(this.o.name, holdId);
  }

  /**
   * Offers the blocks (after the stall hook, so a WRITE comes only after
   * it); settled when written, aborted, failed or at the lease. Only a decode
   * that registered exactly as many blocks is written a whole state.
   */
  async offer(hold: Hold, kv: PrefilledKv, signal: AbortSignal): Promise<void> {
    await stall(this.o.hooks.stallPrefillMs, signal);
    hold.settles(
      this.#sender!.offer(hold.id, hold.ids, { exactBlocks: kv.whole ?? false }).then(
        (r): { reason: ReleaseReason } => ({ reason: r.reason === 'written' ? 'read' : r.reason }),
        // An offer refused outright (the worker closing): its blocks go back as after a failed push.
        (): { reason: ReleaseReason } => ({ reason: 'failed' }),
      ),
    );
  }

  abort(id: string): boolean {
    return this.#sender?.abort(id) ?? false;
  }

  /** A push hold is never read in place. */
  consumed(): void {}

  /** The kv_transfer_params a push prefill answers with (vLLM's push scheduler's). */
  params(o: { id: string; tokens: number }): Record<string, unknown> {
    const side = this.pull.side!;
    return buildKvTransferParams(
      {
        remoteBlockIds: [[]],
        remoteEngineId: this.o.name,
        remoteRequestId: o.id,
        remoteHost: side.host,
        remotePort: side.basePort,
        tpSize: 1,
        ppSize: 1,
        remoteNumTokens: o.tokens,
        transferMode: 'push',
      },
      this.o.wire,
    );
  }

  // ---- decode ----

  /** A model whose KV is one whole sized by the prompt's tokens (a GGUF's state) computes its blocks. */
  plan(kvp: Record<string, unknown>, req: GenerationRequest, known: number | undefined): DecodePlan {
    const blocks = known ?? this.#blocksFor(req);
    try {
      return new PushPlan(this, parsePushParams(kvp), transferId(kvp), blocks);
    } catch (e) {
      throw badParams(e, (e as { code?: string }).code);
    }
  }

  /**
   * Registers the blocks with the prefill the params name and waits for
   * every WRITE. On failure the blocks go back at once when nothing was
   * registered, else once no WRITE can land.
   */
  async receive(plan: PushPlan, taken: Taken, signal: AbortSignal) {
    const requestId = `${plan.transferId}-${randomBytes(4).toString('hex')}`;
    try {
      return await this.#receiver!.receive(plan.params, { requestId, localBlockIds: taken.ids, signal });
    } catch (e) {
      const until = e instanceof PushError ? e.quarantinedUntilMs : undefined;
      if (until === undefined) taken.give();
      else {
        const give = taken.handOver();
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
      throw pushFailure(e, signal);
    }
  }

  /** Blocks of failed receives still waiting out their quarantine. */
  get quarantined(): number {
    return this.#timers.size;
  }

  /** The blocks a push decode registers, from the prompt (a 4xx, or a typed 502, when the model cannot say). */
  #blocksFor(req: GenerationRequest): number {
    if (!this.o.model.pushBlocksFor)
      throw failure('kv_mode_mismatch', 'push mode needs a model that knows its KV blocks from the prompt');
    try {
      return this.o.model.pushBlocksFor(req);
    } catch (e) {
      if (!(e instanceof KvRejected)) throw e;
      throw failure('kv_rejected', `KV push impossible (${e.reason}): ${e.message}`, {
        reason: e.reason,
        nixl_code: e.code,
      });
    }
  }

  async close(): Promise<void> {
    for (const t of this.#timers) clearTimeout(t);
    this.#timers.clear();
    await this.#receiver?.close();
    await this.#sender?.close();
    await this.pull.close();
  }
}

/** A push decode: the checked params, and the blocks the prefill writes into. */
class PushPlan implements DecodePlan {
  constructor(
    private readonly h: PushHandoff,
    readonly params: PushParams,
    readonly transferId: string,
    readonly blocks: number,
  ) {}

  async fetch(taken: Taken, ctx: FetchContext): Promise<Fetched> {
    ctx.span.setAttribute('nixl_node.kv_mode', 'push');
    const t0 = performance.now();
    const got = await this.h.receive(this, taken, ctx.signal);
    const ms = performance.now() - t0;
    return {
      binding: pushBinding(this.params.remoteEngineId, got.requestId),
      ms,
      info: { kv_mode: 'push', kv_push_ms: Math.round(ms * 1000) / 1000 },
    };
  }
}

/** The proxy's transfer_id, else the remote_request_id: the id both legs of one request share. */
function transferId(kvp: Record<string, unknown>): string {
  const t = kvp.transfer_id ?? kvp.remote_request_id;
  if (typeof t !== 'string' || t.length < 1 || t.length > 200 || !isNotifId(t))
    throw failure(
      'invalid_request_error',
      "push kv_transfer_params need a 'transfer_id' (or remote_request_id) usable in a notification",
    );
  return t;
}
