// Bidirectional KV (vLLM #32553): a decode that ends a turn holds the
// conversation's KV and returns kv_transfer_params naming it; the next turn's
// prefill reads what it can reuse instead of recomputing it. Beyond vLLM,
// which checks only counts: the params carry how many tokens the held KV is
// of and a digest of exactly those tokens (signed with the deployment's
// secret like the rest), and the prefill reuses them only when its own
// prompt starts with exactly those tokens. Anything else (a prompt that
// diverges, params of another conversation, counts that do not add up,
// params without a digest, a bad signature) is recomputed, never read.
import { createHash } from 'node:crypto';
import type { KvTransferParams, WireName, WireProfile } from '../handshake/model';
import { parseKvTransferParams } from '../handshake/wire';
import { verifyKvTransferParams } from './params-auth';

/** How many tokens the held KV is of (a nixl-node key; vLLM peers ignore it). */
export const PREFIX_TOKENS_KEY = 'nixl_node_prefix_tokens';
/** sha256 (hex) of those token ids, each as a little-endian u32. */
export const PREFIX_DIGEST_KEY = 'nixl_node_prefix_sha256';

/** vLLM's kv_recompute_threshold when bidirectional KV is on: fewer tokens than this are recomputed. */
export const DEFAULT_RECOMPUTE_THRESHOLD = 64;
/** vLLM's decoder_kv_blocks_ttl: how long a decode holds a finished turn, ms. */
export const DEFAULT_TURN_TTL_MS = 480_000;

/** The digest of token ids that PREFIX_DIGEST_KEY carries. */
export function tokensDigest(tokens: ArrayLike<number>): string {
  const b = Buffer.alloc(tokens.length * 4);
  for (let i = 0; i < tokens.length; i++) b.writeUInt32LE(tokens[i] >>> 0, i * 4);
  return createHash('sha256').update('nixl-node prefix v1\n').update(b).digest('hex');
}

/**
 * A decode's params for its held turn, from the params of its hold as a
 * prefill's would be (buildKvTransferParams): do_remote_decode true and
 * do_remote_prefill false, as vLLM's decode returns them, plus the tokens.
 */
export function turnParams(base: Record<string, unknown>, tokens: ArrayLike<number>): Record<string, unknown> {
  return {
    ...base,
    do_remote_prefill: false,
    do_remote_decode: true,
    [PREFIX_TOKENS_KEY]: tokens.length,
    [PREFIX_DIGEST_KEY]: tokensDigest(tokens),
  };
}

// Whether params name a previous turn is kv_transfer_params vocabulary, shared with the proxy.
export { namesPreviousTurn } from '../handshake/wire';

/** What a prefill checks of a previous turn's params. */
export interface ReuseRules {
  wire?: WireName | WireProfile;
  /** The deployment's secret: unsigned or forged params are not read. */
  secret?: string | Buffer;
  /** Tokens one KV block holds: whole blocks are read (with wholeState: what reused tokens are a multiple of). */
  tokensPerBlock: number;
  /**
   * The held KV is one state (a GGUF's sequence state) whose blocks do not
   * map to tokens: all the blocks the params name are read, and the prefill's
   * model takes its tokens from it (at most `tokens`).
   */
  wholeState?: boolean;
  /** Fewer reusable tokens than this are recomputed (default 64). */
  recomputeThreshold?: number;
}

/** What a prefill may reuse of a previous turn. */
export interface ReusePlan {
  /** Tokens to read (whole blocks); 0: recompute everything. */
  tokens: number;
  /** The first `blocks` of the remote blocks hold them (wholeState: all of them, which hold the state). */
  blocks: number;
  /** Why nothing is read, when tokens is 0. */
  reason?: 'unauthenticated' | 'malformed' | 'unproven' | 'mismatch' | 'below-threshold' | 'nothing-new';
  /** The params, parsed (when they parsed and verified). */
  params?: KvTransferParams;
  /**
   * Tell the decode at once that nothing will be read (it frees its hold):
   * only when the params proved to be of this prompt's prefix, so that
   * someone else's params never free their conversation's hold.
   */
  release: boolean;
}

/**
 * What of the previous turn named by `raw` this prompt may reuse: the held
 * tokens must be exactly the prompt's first tokens (digest and count, signed
 * when there is a secret), and at least one prompt token is left to compute.
 */
export function planReuse(raw: Record<string, unknown>, prompt: ArrayLike<number>, r: ReuseRules): ReusePlan {
  const none = (reason: ReusePlan['reason'], params?: KvTransferParams, release = false): ReusePlan => ({
    tokens: 0,
    blocks: 0,
    reason,
    params,
    release,
  });
  try {
    if (r.secret !== undefined) verifyKvTransferParams(raw, r.secret);
  } catch {
    return none('unauthenticated');
  }
  let p: KvTransferParams;
  try {
    p = parseKvTransferParams(raw, r.wire);
  } catch {
    return none('malformed');
  }
  const n = raw[PREFIX_TOKENS_KEY];
  const digest = raw[PREFIX_DIGEST_KEY];
  // A vLLM decode's params say how many tokens, never which: nothing proves they are this prompt's.
  if (!Number.isSafeInteger(n) || (n as number) < 1 || typeof digest !== 'string') return none('unproven', p);
  const held = n as number;
  if (p.remoteNumTokens !== null && p.remoteNumTokens !== held) return none('mismatch', p);
  if (held > prompt.length || tokensDigest(Array.prototype.slice.call(prompt, 0, held)) !== digest)
    return none('mismatch', p);
  if (p.remoteBlockIds.length !== 1) return none('malformed', p);
  // Whole blocks, and the prompt's last token is always computed here (its logits give the first token).
  const bs = r.tokensPerBlock;
  const blocks = Math.min(Math.floor(held / bs), Math.floor((prompt.length - 1) / bs));
  // The params must name a block for every token they claim (a whole state: at least one).
  const named = p.remoteBlockIds[0].length;
  if (r.wholeState ? named === 0 : Math.ceil(held / bs) > named) return none('mismatch', p);
  const tokens = blocks * bs;
  if (tokens === 0) return none('nothing-new', p, true);
  if (tokens < (r.recomputeThreshold ?? DEFAULT_RECOMPUTE_THRESHOLD)) return none('below-threshold', p, true);
  return { tokens, blocks: r.wholeState ? named : blocks, params: p, release: false };
}
