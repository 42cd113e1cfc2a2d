// The proxy's side of bidirectional KV (as vLLM's disagg_proxy_multiturn):
// a request's top-level `conversation_id` keys the kv_transfer_params its
// decode returned, which the conversation's next turn gives its prefill. The
// params stay on the proxy (clients never send kv_transfer_params); an entry
// is used once, expires with the decode's hold, and the oldest go first when
// there are too many.
import { HttpError } from '../api/http';
import type { StageAnswer } from './transports/types';

/** Where the conversation's key travels in a request (popped: the workers never see it). */
export const CONVERSATION_KEY = 'conversation_id';
/** vLLM's example proxy keeps an entry 450 s (below the decode's 480 s hold) when the decode does not say. */
export const DEFAULT_CONVERSATION_TTL_MS = 450_000;

/** Options of the conversation cache. */
export interface ConversationOptions {
  /** Entries kept at most; the least recently stored go first (default 10000). */
  max?: number;
  /** How long an entry lives when the decode does not say how long it holds the KV (default 450 s). */
  ttlMs?: number;
  /** Taken off what the decode says, so the next prefill reads before the hold ends (default 5 s, vLLM's margin). */
  marginMs?: number;
  /** Monotonic clock, ms (tests). */
  now?: () => number;
}

interface Entry {
  params: Record<string, unknown>;
  until: number;
  /** Frees the decode's hold: the entry went unused (evicted, replaced or expired). */
  drop?: () => void;
}

/** A conversation's previous turn, taken for its next turn's prefill. */
export interface ClaimedTurn {
  /** The params the prefill is given. */
  params: Record<string, unknown>;
  /** Frees the decode's hold (the prefill read nothing from it). */
  release(): void;
}

/** conversation_id -> the params of its last turn's held KV. */
export class Conversations {
  readonly #m = new Map<string, Entry>();
  readonly #max: number;
  readonly #ttl: number;
  readonly #margin: number;
  readonly #now: () => number;
  hits = 0;
  misses = 0;

  constructor(o: ConversationOptions = {}) {
    this.#max = o.max ?? 10_000;
    this.#ttl = o.ttlMs ?? DEFAULT_CONVERSATION_TTL_MS;
    this.#margin = o.marginMs ?? 5000;
    this.#now = o.now ?? (() => performance.now());
  }

  get size(): number {
    return this.#m.size;
  }

  /**
   * The previous turn's params (the entry is used up), with what a prefill
   * needs to read from them, or undefined: a miss (or an expired entry).
   */
  take(id: string): Record<string, unknown> | undefined {
    return this.claim(id)?.params;
  }

  /**
   * take, and what frees the decode's hold when the prefill did not read it
   * (another prompt, forged, below the threshold): the entry was this
   * conversation's own, so nobody else's hold is freed.
   */
  claim(id: string): ClaimedTurn | undefined {
    const e = this.#m.get(id);
    this.#m.delete(id);
    if (!e || e.until <= this.#now()) {
      e?.drop?.();
      this.misses++;
      return undefined;
    }
    this.hits++;
    return { params: { ...e.params, do_remote_decode: true, do_remote_prefill: false }, release: () => e.drop?.() };
  }

  /** Drops the entry of `id` when it still is `params` (its turn's client left), freeing the decode's hold. */
  forget(id: string, params: Record<string, unknown>): void {
    const e = this.#m.get(id);
    if (e?.params !== params) return;
    this.#m.delete(id);
    e.drop?.();
  }

  /**
   * Keeps a turn's params; `holdMs`: how long the decode said it holds the KV
   * (else the default TTL); `drop`: frees the decode's hold when the entry
   * goes unused (evicted, replaced by a newer turn, or found expired).
   */
  put(id: string, params: Record<string, unknown>, holdMs?: unknown, drop?: () => void): void {
    const hold =
      typeof holdMs === 'number' && Number.isFinite(holdMs) && holdMs > 0 ? holdMs - this.#margin : this.#ttl;
    this.#m.get(id)?.drop?.();
    this.#m.delete(id);
    if (hold <= 0) {
      drop?.();
      return;
    }
    this.#m.set(id, { params, until: this.#now() + Math.min(hold, this.#ttl), drop });
    const now = this.#now();
    for (const [k, e] of this.#m) {
      if (this.#m.size <= this.#max && e.until > now) break;
      this.#m.delete(k);
      e.drop?.();
    }
  }
}

/** The request's conversation id, taken out of the body; a 400 unless a string of 1 to 256 characters. */
export function takeConversationId(body: Record<string, unknown>): string | undefined {
  const v = body[CONVERSATION_KEY];
  if (v === undefined || v === null) return undefined;
  delete body[CONVERSATION_KEY];
  if (typeof v !== 'string' || v.length === 0 || v.length > 256)
    throw new HttpError(400, `'${CONVERSATION_KEY}' must be a string of 1 to 256 characters`);
  return v;
}

/**
 * The decode's answer on its way to the client: the params of the KV it
 * holds for the next turn (top level, or the last chunk's) are kept for the
 * conversation, and nixl_node says how many tokens the prefill reused.
 * A turn whose client left (`cut` aborts) before the answer ended is never
 * read: its hold is freed at once, by the params when they came (the
 * conversation's entry dropped), else by the request's id.
 */
export function carryTurn(
  a: StageAnswer,
  o: {
    conversation?: string;
    conversations: Conversations;
    reusedTokens?: number;
    /** Why the prefill read nothing of the previous turn it was given (its kv_reuse_skipped). */
    reuseSkipped?: string;
    /**
     * Frees the decode's hold of the turn: the one its params name (a request
     * without a conversation: no next turn will read it), or, given no id,
     * whatever it holds for this request (its client left before the params came).
     */
    release?: (remoteRequestId?: string) => void;
    /** The client's signal: aborted when it left before the answer ended. */
    cut?: AbortSignal;
    /** More for the answer's nixl_node (the precise policy's decision). */
    annotate?: Record<string, unknown>;
  },
): StageAnswer {
  const free = (kvp: Record<string, unknown>) => {
    if (typeof kvp.remote_request_id === 'string') o.release?.(kvp.remote_request_id);
  };
  let ended = false;
  let kept: Record<string, unknown> | undefined;
  const see = (body: Record<string, unknown>) => {
    ended = true;
    const info = body.nixl_node as Record<string, unknown> | undefined;
    const raw = body.kv_transfer_params;
    const kvp = raw && typeof raw === 'object' && !Array.isArray(raw) ? (raw as Record<string, unknown>) : undefined;
    // Only a decode's hold of its turn (a nixl-node decode says how long it holds it).
    const held = kvp !== undefined && info?.kv_hold_ms !== undefined;
    if (o.conversation !== undefined && kvp && !o.cut?.aborted) {
      o.conversations.put(o.conversation, kvp, info?.kv_hold_ms, held ? () => free(kvp) : undefined);
      kept = kvp;
    } else if (held) free(kvp);
    if (o.reusedTokens !== undefined && (info || kvp !== undefined || body.usage !== undefined))
      body.nixl_node = {
        ...info,
        kv_reused_tokens: o.reusedTokens,
        ...(o.reuseSkipped !== undefined ? { kv_reuse_skipped: o.reuseSkipped } : {}),
      };
    if (o.annotate) body.nixl_node = { ...(body.nixl_node as object | undefined), ...o.annotate };
  };
  if (a.json && a.status < 400) see(a.json);
  const onCut = () => {
    if (kept && o.conversation !== undefined) o.conversations.forget(o.conversation, kept);
    else if (!ended) o.release?.();
  };
  if (o.cut?.aborted) onCut();
  else o.cut?.addEventListener('abort', onCut, { once: true });
  const chunks = a.chunks;
  if (!chunks) return a;
  return {
    ...a,
    chunks: (async function* () {
      for await (const c of chunks) {
        if (c.nixl_node !== undefined || c.kv_transfer_params !== undefined) see(c);
        yield c;
      }
    })(),
  };
}
