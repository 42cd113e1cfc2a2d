// How a request's KV gets from its prefill to its decode: a KvHandoff, pull
// (handoff-pull.ts) or push (handoff-push.ts), picked once when the proxy
// starts. What both need is here: the legs' bodies, the decode's max_tokens,
// and the checks made before any work.
import { GENERATE_PATH, generateDecodeBody, generatePrefillBody } from '../api/generate';
import type { ClaimedTurn } from './conversations';
import type { Stage, WorkerPool } from './pool';
import { type ProxyRequest, StageFailure, type StageResult } from './stage-call';

/** The decode's answer, and what the prefill said of the conversation's previous turn (pull only). */
export interface HandedOff extends StageResult {
  turn?: {
    /** The prefill was given a previous turn to read. */
    named: boolean;
    /** Its kv_reused_tokens, as it said them. */
    reused: unknown;
    /** Its kv_reuse_skipped: why it read nothing of it. */
    skipped?: string;
  };
}

/** One way KV moves between the legs of a request. */
export interface KvHandoff {
  /**
   * Whether a conversation's previous turn is given to the prefill and the
   * decode's held turn kept for the next (bidirectional KV).
   */
  readonly carriesTurns: boolean;
  /** The prefill and decode legs of one request; the decode's answer. */
  run(r: ProxyRequest, turn?: ClaimedTurn): Promise<HandedOff>;
}

/** The prefill leg's body: the client's, asking one token (not streamed) and these kv_transfer_params. */
export function prefillBodyOf(r: ProxyRequest, kv: Record<string, unknown>): Record<string, unknown> {
  if (r.path === GENERATE_PATH) return generatePrefillBody(r.body, kv);
  const b: Record<string, unknown> = { ...r.body, stream: false, max_tokens: 1, kv_transfer_params: kv };
  if (r.path === '/v1/chat/completions') b.max_completion_tokens = 1;
  delete b.stream_options;
  return b;
}

/** The decode leg's body: the client's, with these kv_transfer_params. */
export function decodeBodyOf(r: ProxyRequest, kv: Record<string, unknown>): Record<string, unknown> {
  return r.path === GENERATE_PATH ? generateDecodeBody(r.body, kv) : { ...r.body, kv_transfer_params: kv };
}

/** The tokens the decode will generate, when the request says (completions, chat or generate). */
export function decodeMaxTokens(body: Record<string, unknown>): number | undefined {
  const max =
    body.max_tokens ??
    body.max_completion_tokens ??
    (body.sampling_params as Record<string, unknown> | undefined)?.max_tokens;
  return typeof max === 'number' ? max : undefined;
}

/**
 * No prefill for a decode that cannot take it: its blocks would wait a whole
 * lease for a read that never comes, and fill the prefill's cache.
 */
export function checkLegs(pools: Readonly<Record<Stage, WorkerPool>>): void {
  if (!pools.prefill.anyHealthy) throw new StageFailure(503, 'prefill', undefined, 'no healthy prefill worker');
  if (!pools.decode.anyHealthy)
    throw new StageFailure(503, 'decode', undefined, 'no healthy decode worker (nothing was prefilled)');
}

/** The request's model, when it names one. */
export function modelOf(body: Record<string, unknown>): string | undefined {
  return typeof body.model === 'string' ? body.model : undefined;
}
