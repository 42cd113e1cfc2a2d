// A worker's side of bidirectional KV (vLLM #32553; lib/kv/turn-params.ts):
//   decode   after answering, holds the KV of the prompt and the answer in
//            new blocks under a fixed lease (vLLM decoder_kv_blocks_ttl, no
//            heartbeats) and returns kv_transfer_params naming them;
//   prefill  given such params for the next turn, reads the first blocks of
//            that KV when they are provably of its prompt's first tokens,
//            and computes only the rest. Whatever goes wrong (expired,
//            gone, another prompt, forged) is recomputed, never an error.
import { randomUUID } from 'node:crypto';
import type { WireName } from '../../handshake/model';
import { buildKvTransferParams } from '../../handshake/wire';
import type { PullError } from '../../kv/pull/puller';
import { signKvTransferParams } from '../../kv/params-auth';
import { type ReusePlan, planReuse, turnParams } from '../../kv/turn-params';
import type { SpanLike } from '../../tracing';
import { type Tamper, tamperEnvelope } from '../models/kv-state';
import type { GenerationRequest, PrefilledKv, PreviousTurn, ServingModel, TurnKvState } from '../models/types';
import type { BlockStore } from './block-store';
import type { PullSide } from './handoff';
import type { HoldTable } from './holds';

/** What TurnKv needs of its worker: its blocks, its holds, and the pull that reads and holds turns. */
export interface TurnDeps {
  name: string;
  wire?: WireName;
  secret?: string;
  model: ServingModel;
  /** The worker's KV cache blocks. @internal */
  blocks: BlockStore;
  /** Where a held turn is filed, and freed. @internal */
  holds: HoldTable;
  /** The tracker that holds a turn, the puller that reads one, the side channel the params name. @internal */
  pull: PullSide;
  /** How long a finished turn is held, ms. */
  ttlMs: number;
  /**
   * Blocks held turns may take together: past it a turn is not held (its
   * next turn recomputes), so held turns never starve new requests.
   */
  maxHeldBlocks: number;
  recomputeThreshold?: number;
  /** The handshake with the decode holding the previous turn: one attempt of this many ms. */
  reuseHandshakeMs?: number;
  /** Test hook (GGUF): damages a held turn's KV once written. */
  tamperKv?: Tamper;
}

/** The default of TurnDeps.reuseHandshakeMs. */
export const DEFAULT_REUSE_HANDSHAKE_MS = 1000;

/** Counters of a worker's turns. */
export interface TurnStats {
  /** Decode: turns whose KV it held for a next turn. */
  turnsHeld: number;
  /** Prefill: turns that read a previous turn's KV, and the tokens they did not recompute. */
  turnsReused: number;
  reusedTokens: number;
  /** Prefill: turns given a previous turn it did not read (why in the answer's nixl_node.kv_reuse_skipped). */
  turnsRecomputed: number;
}

/** A turn a decode holds: the params naming it, and for how long (ms from now). */
export interface HeldTurn {
  params: Record<string, unknown>;
  holdMs: number;
}

/**
 * The request a turn is held for: the proxy's id, by which the proxy
 * releases it when its client left before the params reached it; and the
 * request's signal, aborted when the decode's own client left before the
 * answer was written (no one got the params, so no one will read it).
 */
export interface TurnOwner {
  requestId: string;
  signal: AbortSignal;
}

/** What a prefill took of a previous turn. */
export interface Reuse {
  tokens: number;
  blocks: number;
  /** Why nothing was read. */
  skipped?: string;
}

/** A worker's holds of finished turns, and its reads of them. */
export class TurnKv {
  readonly stats: TurnStats = { turnsHeld: 0, turnsReused: 0, reusedTokens: 0, turnsRecomputed: 0 };
  #seq = 0;

  constructor(private readonly d: TurnDeps) {}

  /** Turns held right now. */
  get held(): number {
    return this.d.holds.count('turn');
  }

  /** Blocks they take. */
  get heldBlocks(): number {
    return this.d.holds.turnBlocks;
  }

  /**
   * Decode: holds the KV of the answered turn and returns the params that
   * name it (signed with the secret), or undefined when the model keeps no
   * such KV or the cache has no room (the next turn then recomputes).
   * `made`: the turn's KV as the model made it while decoding (GGUF), else
   * the model makes it from the text. `owner`: the request it is held for
   * (the hold ends with it when its client leaves first).
   */
  keep(req: GenerationRequest, text: string, made?: TurnKvState, owner?: TurnOwner): HeldTurn | undefined {
    const { holds, blocks, pull } = this.d;
    if (owner && (owner.signal.aborted || holds.releasedEarly(owner.requestId))) return undefined;
    const kv = made ?? this.d.model.turnKv?.(req, text);
    if (!kv || kv.tokens.length === 0) return undefined;
    if (holds.turnBlocks + kv.blocks > this.d.maxHeldBlocks) return undefined;
    const ids = blocks.take(kv.blocks);
    if (!ids) return undefined;
    const id = `turn-${++this.#seq}-${randomUUID()}`;
    kv.writeTo(blocks.view(ids), { engineId: this.d.name, requestId: id, blockIds: ids });
    // A decode's held turns are damaged too (GGUF: the next prefill must refuse them).
    if (this.d.tamperKv)
      tamperEnvelope(blocks.view(ids), ids.length, this.d.model.geometry.blockBytes, this.d.tamperKv, this.d.secret);
    const hold = holds.add({
      id,
      ids,
      kind: 'turn',
      keeper: pull,
      requestId: owner?.requestId,
      signal: owner?.signal,
    });
    hold.settles(pull.tracker.expect(id, ids, { leaseMs: this.d.ttlMs, renewable: false }));
    this.stats.turnsHeld++;
    const expiry = pull.tracker.leaseExpiry(id);
    const side = pull.side!;
    const base = buildKvTransferParams(
      {
        remoteBlockIds: [ids],
        remoteEngineId: this.d.name,
        remoteRequestId: id,
        remoteHost: side.host,
        remotePort: side.basePort,
        tpSize: 1,
        remoteNumTokens: kv.tokens.length,
        // In the clock of the side channel's replies, as the prefill's.
        remoteBlocksExpiryTime: expiry === undefined ? null : expiry / 1000,
      },
      this.d.wire,
    );
    const params = turnParams(base, kv.tokens);
    return {
      params: this.d.secret === undefined ? params : signKvTransferParams(params, this.d.secret),
      holdMs: this.d.ttlMs,
    };
  }

  /**
   * Prefill of a model whose held turns are one state (wholeTurnReuse): when
   * the params prove to be of this prompt's first tokens, reads the whole
   * state into blocks of its own for the time of the prefill, and the model
   * evaluates the prompt from what it takes of it (it checks the state as a
   * decode does, and its tokens against the prompt's). Whatever fails is
   * recomputed.
   */
  async prefillFrom(
    kvp: Record<string, unknown>,
    req: GenerationRequest,
    signal: AbortSignal,
    span: SpanLike,
  ): Promise<{ kv: PrefilledKv; reuse: Reuse }> {
    const granularity = this.d.model.wholeTurnReuse?.granularity ?? 0;
    const prompt = this.d.model.promptTokenIds?.(req);
    const plan: ReusePlan =
      prompt && granularity > 0
        ? planReuse(kvp, prompt, {
            wire: this.d.wire,
            secret: this.d.secret,
            tokensPerBlock: granularity,
            wholeState: true,
            recomputeThreshold: this.d.recomputeThreshold,
          })
        : { tokens: 0, blocks: 0, reason: 'unproven', release: false };
    let skipped: string | undefined = plan.reason;
    let tmp: number[] | undefined;
    let previous: PreviousTurn | undefined;
    try {
      if (plan.params && plan.tokens === 0 && plan.release)
        await this.#read(plan.params, [], 0, signal, span).catch(() => {});
      else if (plan.params && plan.tokens > 0) {
        tmp = this.d.blocks.take(plan.blocks);
        if (!tmp) skipped = 'no-room';
        else
          try {
            await this.#read(plan.params, tmp, plan.blocks, signal, span);
            const p = plan.params;
            previous = {
              view: this.d.blocks.view(tmp),
              blocks: plan.blocks,
              tokens: plan.tokens,
              binding: { engineId: p.remoteEngineId, requestId: p.remoteRequestId, blockIds: p.remoteBlockIds[0] },
            };
          } catch (e) {
            skipped = `pull-failed:${(e as PullError).kind ?? 'local'}`;
          }
      }
      const kv = await this.d.model.prefill(req, signal, previous);
      const tokens = previous ? (kv.turn?.reused ?? 0) : 0;
      if (previous) skipped = tokens > 0 ? undefined : (kv.turn?.skipped ?? 'mismatch');
      this.#count(tokens, span);
      return { kv, reuse: { tokens, blocks: 0, ...(skipped !== undefined ? { skipped } : {}) } };
    } finally {
      if (tmp) this.d.blocks.give(tmp);
    }
  }

  /** Reads the first `blocks` of the previous turn's blocks into `ids` (copied when held here). */
  async #read(
    p: NonNullable<ReusePlan['params']>,
    ids: readonly number[],
    blocks: number,
    signal: AbortSignal,
    span: SpanLike,
  ): Promise<void> {
    if (p.remoteEngineId === this.d.name) this.#copyHere(p, ids, blocks);
    else
      await this.d.pull.puller.pullFromParams(p, {
        localBlockIds: ids.slice(0, blocks),
        continuation: true,
        signal,
        timeoutMs: 30_000,
        handshake: { timeoutMs: this.d.reuseHandshakeMs ?? DEFAULT_REUSE_HANDSHAKE_MS, retries: 0 },
        traceContext: span.context,
      });
  }

  #count(tokens: number, span: SpanLike): void {
    span.setAttribute('nixl_node.kv_reused_tokens', tokens);
    if (tokens > 0) {
      this.stats.turnsReused++;
      this.stats.reusedTokens += tokens;
    } else this.stats.turnsRecomputed++;
  }

  /**
   * Prefill: fills the first blocks of `ids` with the previous turn's KV
   * that `kvp` names, when provably of this prompt; says how many.
   */
  async reuse(
    kvp: Record<string, unknown>,
    req: GenerationRequest,
    ids: readonly number[],
    signal: AbortSignal,
    span: SpanLike,
  ): Promise<Reuse> {
    const prompt = this.d.model.promptTokenIds?.(req);
    const plan: ReusePlan = prompt
      ? planReuse(kvp, prompt, {
          wire: this.d.wire,
          secret: this.d.secret,
          tokensPerBlock: this.d.model.geometry.tokensPerBlock,
          recomputeThreshold: this.d.recomputeThreshold,
        })
      : { tokens: 0, blocks: 0, reason: 'unproven', release: false };
    let r: Reuse = { tokens: 0, blocks: 0, skipped: plan.reason };
    if (plan.params && (plan.tokens > 0 || plan.release)) {
      const blocks = plan.blocks;
      try {
        await this.#read(plan.params, ids, blocks, signal, span);
        if (blocks > 0) r = { tokens: plan.tokens, blocks };
      } catch (e) {
        // The KV we may have read is not trusted: every block is computed again.
        const err = e as PullError;
        r = { tokens: 0, blocks: 0, skipped: `pull-failed:${err.kind ?? 'local'}` };
      }
    }
    this.#count(r.tokens, span);
    return r;
  }

  /** The previous turn is held by this worker: its blocks are copied, then freed. */
  #copyHere(p: NonNullable<ReusePlan['params']>, ids: readonly number[], blocks: number): void {
    const held = this.d.holds.blocksOf(p.remoteRequestId, 'turn');
    // Only a hold of exactly those blocks (anything else is forged or expired).
    if (!held || held.join() !== p.remoteBlockIds[0]?.join()) throw { kind: 'expired' };
    const from = this.d.blocks.view(held);
    const to = this.d.blocks.view(ids);
    for (let b = 0; b < blocks; b++) for (let l = 0; l < this.d.model.geometry.layers; l++) from(b, l).copy(to(b, l));
    this.d.holds.consumed(p.remoteRequestId);
  }
}
