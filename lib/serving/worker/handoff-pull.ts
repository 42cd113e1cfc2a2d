// Pull mode (vLLM NixlConnector): a prefill holds its blocks until the
// decode reads them or the lease ends (PrefillTracker); a decode reads the
// blocks its kv_transfer_params name (KvPuller), parsed and checked once.
import { randomUUID } from 'node:crypto';
import type { KvTransferParams } from '../../handshake/model';
import type { HandshakeServer } from '../../handshake/types';
import { buildKvTransferParams, parseKvTransferParams } from '../../handshake/wire';
import { LeaseBoard } from '../../kv/lease-board';
import { verifyKvTransferParams } from '../../kv/params-auth';
import { PrefillTracker, servePrefill } from '../../kv/prefill';
import { KvPuller } from '../../kv/pull/puller';
import type { PullError } from '../../kv/pull/types';
import { failure } from '../api/errors';
import type { GenerationRequest, KvBinding, PrefilledKv } from '../models/types';
import type { Taken } from './block-store';
import { badParams, pullFailure, pullSetupFailure } from './failures';
import {
  type DecodePlan,
  type FetchContext,
  type Fetched,
  type HandoffOptions,
  type KvHandoff,
  type KvRoute,
  type SideChannelOptions,
  bindingOf,
} from './handoff';
import { asksForPush } from './handoff-push';
import type { Hold } from './holds';
import { stall } from './test-hooks';

/** Pull: the worker's KV mode, and the route of a request in it. */
export class PullHandoff implements KvHandoff, KvRoute {
  readonly pull = this;
  readonly puller: KvPuller;
  readonly tracker: PrefillTracker;
  side?: HandshakeServer;
  #seq = 0;

  constructor(readonly o: HandoffOptions) {
    this.puller = new KvPuller({
      agent: o.agent,
      layout: o.layout,
      peers: o.peers,
      wire: o.wire,
      kvLeaseMs: o.leaseMs,
      // A prefill of another model fails at the handshake, before any read.
      expectedHash: o.model.compatibilityHash,
    });
    this.tracker = new PrefillTracker({
      agent: o.agent,
      tpSize: 1,
      wire: o.wire,
      leaseMs: o.leaseMs,
      now: o.now,
      logger: { warn() {} },
      // nixl-node decodes confirm each read against it; vLLM decodes never look.
      board: new LeaseBoard(),
    });
    // Released holds are counted where they end (holds.ts); a late read only here.
    this.tracker.sinks.add({ released: () => {}, unrecognized: () => {}, lateRead: () => o.stats.lateReads++ });
  }

  async start(o: SideChannelOptions): Promise<void> {
    this.side = await servePrefill({
      ranks: [{ agent: this.o.agent, layout: this.o.layout, leaseBoard: this.tracker.board }],
      compatibilityHash: o.hash ?? this.o.model.compatibilityHash,
      host: o.host,
      port: o.port,
      wire: this.o.wire,
      logger: { warn() {} },
      // The clock its v12 replies carry: the one remote_blocks_expiry_time is on.
      clock: () => this.o.now() / 1000,
    });
  }

  pick(kvp: Record<string, unknown> | undefined): KvRoute {
    if (asksForPush(kvp))
      throw failure('kv_mode_mismatch', 'this worker moves KV in pull mode; these kv_transfer_params ask for push');
    return this;
  }

  health(): Record<string, unknown> {
    return { kv_mode: 'pull' };
  }

  // ---- prefill ----

  checkPrefill(): void {}

  holdId(): string {
    // Never made of client input: it travels in notifications ("<id>:<n>", "HB:<id>,...").
    return `kv-${++this.#seq}-${randomUUID()}`;
  }

  checkKv(_kv: PrefilledKv): void {}

  binding(holdId: string, ids: number[]): KvBinding {
    return { engineId: this.o.name, requestId: holdId, blockIds: ids };
  }

  async offer(hold: Hold, _kv: PrefilledKv, signal: AbortSignal): Promise<void> {
    hold.settles(this.tracker.expect(hold.id, hold.ids));
    await stall(this.o.hooks.stallPrefillMs, signal);
  }

  abort(id: string): boolean {
    return this.tracker.abort(id);
  }

  consumed(id: string): void {
    this.tracker.release(id);
  }

  params(o: { id: string; ids: number[]; tokens: number }): Record<string, unknown> {
    const ms = this.tracker.leaseExpiry(o.id);
    return buildKvTransferParams(
      {
        remoteBlockIds: [o.ids],
        remoteEngineId: this.o.name,
        remoteRequestId: o.id,
        remoteHost: this.side!.host,
        remotePort: this.side!.basePort,
        tpSize: 1,
        remoteNumTokens: o.tokens,
        // When the tracker frees the blocks unless read, on the clock the
        // side channel sends (performance.now, seconds), as vLLM does.
        remoteBlocksExpiryTime: ms === undefined ? null : ms / 1000,
      },
      this.o.wire,
    );
  }

  // ---- decode ----

  /** The params as the prefill sent them, verified (with a secret) and parsed: 400 when they are not. */
  parse(kvp: Record<string, unknown>): KvTransferParams {
    try {
      if (this.o.secret !== undefined) verifyKvTransferParams(kvp, this.o.secret);
      return parseKvTransferParams(kvp, this.o.wire);
    } catch (e) {
      throw badParams(e);
    }
  }

  /**
   * Parses the params once; a 400 before any pull when the prompt the
   * prefill evaluated (remote_num_tokens) and max_tokens cannot fit the
   * model's context, as one worker answers the same request (params that do
   * not say, vLLM v0.13, are checked by the model once it reads the KV).
   */
  plan(kvp: Record<string, unknown>, req: GenerationRequest, known: number | undefined): DecodePlan {
    let p: KvTransferParams;
    try {
      p = parseKvTransferParams(kvp, this.o.wire);
    } catch (e) {
      // A model that sizes its KV from the prompt lets the pull say what is wrong with them.
      throw known === undefined ? badParams(e) : pullSetupFailure(kvp.remote_request_id, e);
    }
    fitsContext(this.o.model.contextSize, req, p.remoteNumTokens);
    const blocks = known ?? p.remoteBlockIds[0]?.length ?? 0;
    if (blocks < 1) throw badParams(new Error('no remote blocks'));
    try {
      if (this.o.secret !== undefined) verifyKvTransferParams(kvp, this.o.secret);
    } catch (e) {
      throw pullSetupFailure(p.remoteRequestId, e);
    }
    return new PullPlan(this, p, blocks);
  }

  async close(): Promise<void> {
    await this.side?.close();
    await this.puller.close();
    await this.tracker.close();
    // Last: every role that shared the peers is closed (push closes this side last).
    await this.o.peers.close();
  }
}

/** A pull decode: the checked params, pulled into the decode's blocks. */
class PullPlan implements DecodePlan {
  constructor(
    private readonly h: PullHandoff,
    readonly params: KvTransferParams,
    readonly blocks: number,
  ) {}

  async fetch(taken: Taken, ctx: FetchContext): Promise<Fetched> {
    await stall(this.h.o.hooks.stallDecodeMs, ctx.signal);
    const t0 = performance.now();
    const pull = () =>
      this.h.puller.pullFromParams(this.params, {
        traceContext: ctx.span.context,
        localBlockIds: taken.ids,
        signal: ctx.signal,
        timeoutMs: 30_000,
        issuedAtMs: ctx.arrivedMs,
      });
    try {
      await pull().catch((e: PullError) => {
        // The prefill restarted at the address we knew (same side channel):
        // our connection was to its dead incarnation, which the puller has
        // dropped. Once more, from a fresh handshake with the new one.
        if (e.kind !== 'peer-gone' || ctx.signal.aborted) throw e;
        return pull();
      });
    } catch (e) {
      const h = pullFailure(e);
      // Not this worker's fault nor the client's: the proxy prefills again.
      if (h.code === 'kv_expired') this.h.o.stats.pullsExpired++;
      throw h;
    }
    const ms = performance.now() - t0;
    return { binding: bindingOf(this.params), ms, info: { kv_mode: 'pull', kv_pull_ms: Math.round(ms * 1000) / 1000 } };
  }
}

function fitsContext(ctx: number | undefined, req: GenerationRequest, prompt: number | null): void {
  if (ctx === undefined || prompt === null || prompt + req.maxTokens <= ctx) return;
  throw failure(
    'invalid_request_error',
    `this model's context holds ${ctx} tokens; the request needs ${prompt + req.maxTokens} ` +
      `(${prompt} in the prompt, ${req.maxTokens} to generate)`,
  );
}
