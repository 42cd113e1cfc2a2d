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
import type { HandshakeServer } from '../../handshake/types';
import { buildKvTransferParams } from '../../handshake/wire';
import type { PrefillTracker } from '../../kv/prefill';
import type { KvPuller, PullError } from '../../kv/pull/puller';
import { signKvTransferParams } from '../../kv/params-auth';
import { type ReusePlan, planReuse, turnParams } from '../../kv/turn-params';
import type { SpanLike } from '../../tracing';
import type {
  BlockView,
  GenerationRequest,
  PrefilledKv,
  PreviousTurn,
  ServingModel,
  TurnKvState,
} from '../models/types';

/** What TurnKv needs of its worker. */
export interface TurnDeps {
  name: string;
  wire?: WireName;
  secret?: string;
  model: ServingModel;
  tracker: PrefillTracker;
  puller: KvPuller;
  /** Its side channel (where the params say a prefill handshakes). */
  side(): HandshakeServer;
  /** Free blocks, or undefined when there are not that many. */
  take(n: number): number[] | undefined;
  /** Gives blocks back. */
  give(ids: number[]): void;
  /** The blocks `ids` of its pool, as a model reads and writes them. */
  view(ids: readonly number[]): BlockView;
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
  /** Whether a release of this request id (the proxy's) came before its turn was held: then none is. */
  releasedEarly?(requestId: string): boolean;
  /** Test hook: damages a held turn's KV once written (its `n` blocks). */
  tamper?: (view: BlockView, n: number) => void;
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
  /** Turns held here, by the id their params carry. */
  readonly #held = new Map<string, number[]>();
  /** The turns held for each request id (TurnOwner). */
  readonly #of = new Map<string, Set<string>>();
  #heldBlocks = 0;
  #seq = 0;

  constructor(private readonly d: TurnDeps) {}

  /** Turns held right now. */
  get held(): number {
    return this.#held.size;
  }

  /** Blocks they take. */
  get heldBlocks(): number {
    return this.#heldBlocks;
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
    if (owner && (owner.signal.aborted || this.d.releasedEarly?.(owner.requestId))) return undefined;
    const kv = made ?? this.d.model.turnKv?.(req, text);
    if (!kv || kv.tokens.length === 0) return undefined;
    if (this.#heldBlocks + kv.blocks > this.d.maxHeldBlocks) return undefined;
    const ids = this.d.take(kv.blocks);
    if (!ids) return undefined;
    this.#heldBlocks += ids.length;
    const id = `turn-${++this.#seq}-${randomUUID()}`;
    kv.writeTo(this.d.view(ids), { engineId: this.d.name, requestId: id, blockIds: ids });
    this.d.tamper?.(this.d.view(ids), ids.length);
    this.#held.set(id, ids);
    const mine = owner && this.#own(id, owner);
    void this.d.tracker.expect(id, ids, { leaseMs: this.d.ttlMs, renewable: false }).then(() => {
      mine?.();
      this.#held.delete(id);
      this.#heldBlocks -= ids.length;
      this.d.give(ids);
    });
    this.stats.turnsHeld++;
    const expiry = this.d.tracker.leaseExpiry(id);
    const side = this.d.side();
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

  /** Frees the turns held for a request id now (its client left); how many. */
  releaseRequest(requestId: string): number {
    let n = 0;
    for (const id of [...(this.#of.get(requestId) ?? [])]) if (this.d.tracker.abort(id)) n++;
    return n;
  }

  /** Files turn `id` under its owner, freed when the owner's signal aborts; returns what unfiles it. */
  #own(id: string, o: TurnOwner): () => void {
    const set = this.#of.get(o.requestId) ?? new Set<string>();
    this.#of.set(o.requestId, set.add(id));
    const cut = () => this.d.tracker.abort(id);
    o.signal.addEventListener('abort', cut, { once: true });
    return () => {
      o.signal.removeEventListener('abort', cut);
      set.delete(id);
      if (set.size === 0 && this.#of.get(o.requestId) === set) this.#of.delete(o.requestId);
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
        await this.#read(kvp, plan.params, [], 0, signal, span).catch(() => {});
      else if (plan.params && plan.tokens > 0) {
        tmp = this.d.take(plan.blocks);
        if (!tmp) skipped = 'no-room';
        else
          try {
            await this.#read(kvp, plan.params, tmp, plan.blocks, signal, span);
            const p = plan.params;
            previous = {
              view: this.d.view(tmp),
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
      if (tmp) this.d.give(tmp);
    }
  }

  /** Reads the first `blocks` of the previous turn's blocks into `ids` (copied when held here). */
  async #read(
    kvp: Record<string, unknown>,
    p: NonNullable<ReusePlan['params']>,
    ids: readonly number[],
    blocks: number,
    signal: AbortSignal,
    span: SpanLike,
  ): Promise<void> {
    if (p.remoteEngineId === this.d.name) this.#copyHere(p, ids, blocks);
    else
      await this.d.puller.pullFromParams(kvp, {
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
        await this.#read(kvp, plan.params, ids, blocks, signal, span);
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
    const held = this.#held.get(p.remoteRequestId);
    // Only a hold of exactly those blocks (anything else is forged or expired).
    if (!held || held.join() !== p.remoteBlockIds[0]?.join()) throw { kind: 'expired' };
    const from = this.d.view(held);
    const to = this.d.view(ids);
    for (let b = 0; b < blocks; b++) for (let l = 0; l < this.d.model.geometry.layers; l++) from(b, l).copy(to(b, l));
    this.d.tracker.release(p.remoteRequestId);
  }
}
