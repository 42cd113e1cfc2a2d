// A GGUF's KV in push mode. A push decode registers its blocks with the
// prefill before the prefill has evaluated anything, so it must know how many
// blocks the prefill's state will take from the request alone. It can: a
// sequence state of one llama.cpp context (seq-state.ts) is a function of
// the model, the cache layout and the prompt's token count N, and the decode
// has the same model and tokenizes the prompt the same way. So both sides
// compute the same size, and each checks the other's side of it:
//   decode   registers exactly the blocks of its prompt's state, and refuses
//            a state whose tokens are not its prompt's (before llama.cpp
//            sees a byte: the envelope and the parse run first);
//   prefill  checks the state it saved is exactly what a decode computes
//            from the request (tokens and bytes), else refuses to push it,
//            and WRITEs only to a decode that registered exactly its
//            blocks (never a truncated or padded state).
import { envelopeBytes } from '../kv-state';
import { type LlamaStateLayout, ggmlRowSize, ggmlTypeSize } from './seq-state';
import { KvRejected } from '../types';

/**
 * Bytes of the sequence state llama.cpp saves for a prompt of `tokens`
 * tokens in a context of layout `L` (the layout parseSeqState accepts,
 * byte for byte); undefined when the layout names a type it cannot size.
 */
export function seqStateBytes(L: LlamaStateLayout, tokens: number): number | undefined {
  // magic, version, n_tokens, the token ids, n_stream, cell_count
  let n = 12 + 4 * tokens + 8;
  if (tokens === 0) return n;
  // the cells, then v_trans and n_layer
  n += 12 * tokens + 8;
  for (const w of L.embdK) {
    const row = ggmlRowSize(L.kType, w);
    if (row === undefined) return undefined;
    n += 4 + 8 + row * tokens;
  }
  for (const w of L.embdV) {
    if (!L.vTrans) {
      const row = ggmlRowSize(L.vType, w);
      if (row === undefined) return undefined;
      n += 4 + 8 + row * tokens;
    } else {
      const el = ggmlTypeSize(L.vType);
      if (el === undefined) return undefined;
      n += 4 + 4 + 4 + w * tokens * el;
    }
  }
  return n;
}

/**
 * Tokens of a context node-llama-cpp fills with a prompt: LlamaCompletion
 * and LlamaChat keep their default contextShiftSize (a tenth) free.
 */
export function promptRoom(contextSize: number): number {
  return contextSize - Math.max(1, Math.floor(contextSize / 10));
}

/**
 * The tokens node-llama-cpp evaluates of a prompt (`tokens`: BOS first when
 * the model prepends one), or why a decode cannot know them. A completion
 * longer than promptRoom is cut from the start behind the BOS, as
 * LlamaCompletion's fitInputIntoContext cuts it; a chat that long would have
 * its history compressed by LlamaChat, which a decode cannot predict.
 */
export function evaluatedPrompt(
  tokens: readonly number[],
  o: { chat: boolean; contextSize: number; bos: boolean },
): readonly number[] | string {
  const room = promptRoom(o.contextSize);
  if (tokens.length <= room) return tokens;
  if (o.chat)
    return (
      `the chat prompt is ${tokens.length} tokens; in push mode it must fit whole in ${room} ` +
      `(the context less a tenth), or node-llama-cpp drops history a decode cannot size beforehand`
    );
  const head = o.bos ? tokens.slice(0, 1) : [];
  const keep = room - head.length;
  if (keep < 1) return `a context of ${o.contextSize} tokens is too small to evaluate a prompt`;
  return [...head, ...tokens.slice(-keep)];
}

/** What a push decode registers for a prompt: the state's bytes and the blocks its envelope takes. */
export interface PushSize {
  tokens: number;
  stateBytes: number;
  blocks: number;
}

/** The size of a prompt's state in blocks of `blockBytes` (its envelope's header included). */
export function pushSize(L: LlamaStateLayout, tokens: number, blockBytes: number): PushSize {
  const stateBytes = seqStateBytes(L, tokens);
  if (stateBytes === undefined)
    throw new KvRejected(
      'the KV cache type of this model has no known size: its states cannot be pushed',
      'unsupported',
    );
  return { tokens, stateBytes, blocks: Math.ceil(envelopeBytes(stateBytes) / blockBytes) };
}

/**
 * Why a state a prefill saved is not what a push decode computes from the
 * same request (its tokens, or its bytes), or undefined when it is.
 */
export function unpushable(
  L: LlamaStateLayout | string,
  predicted: readonly number[] | string | undefined,
  saved: readonly number[],
  stateBytes: number,
): string | undefined {
  if (typeof L === 'string') return `its states cannot be checked (${L})`;
  if (!predicted) return 'the request gives no prompt tokens to size the state by';
  if (typeof predicted === 'string') return predicted;
  if (!sameTokens(predicted, saved))
    return `the prompt evaluated as ${saved.length} tokens that are not the ${predicted.length} a decode computes from the request`;
  const want = seqStateBytes(L, saved.length);
  if (want !== stateBytes)
    return `the state of ${saved.length} tokens is ${stateBytes} bytes, a decode computes ${want ?? 'no size'}`;
  return undefined;
}

/** A push decode's check of the state it was written: exactly its own prompt's tokens. */
export function checkOwnPrompt(state: readonly number[], prompt: readonly number[] | undefined): void {
  if (prompt && sameTokens(state, prompt)) return;
  const at = prompt ? firstDifference(state, prompt) : 0;
  throw new KvRejected(
    `the KV state written here holds ${state.length} tokens that are not this request's prompt ` +
      `(${prompt?.length ?? 0} tokens; they differ from token ${at}): another prompt's KV, not loaded`,
    'wrong-request',
  );
}

function sameTokens(a: readonly number[], b: readonly number[]): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

function firstDifference(a: readonly number[], b: readonly number[]): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return n;
}
