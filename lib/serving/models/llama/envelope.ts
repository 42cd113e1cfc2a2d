// A GGUF's KV in blocks: its sequence state in the envelope of kv-state.ts.
// Sealing wraps a state a prefill (or a decode holding a turn) saved, bound
// to the request whose blocks it goes into; opening checks the envelope, then
// every byte of the state for this model and context (seq-state.ts), before
// llama.cpp sees one. Both move the state through a buffer of the model's
// StateBuffers (state-buffers.ts) and say when it is given back.
import { NixlError } from '../../../errors';
import {
  type Continuation,
  HEADER_BYTES,
  type StateInfo,
  envelopeBytes,
  openEnvelope,
  stateHeader,
  writeEnvelope,
} from '../kv-state';
import { type GenerationRequest, type KvBinding, type KvInput, KvRejected, type TurnKvState } from '../types';
import type { LoadedLlama } from './model';
import { pushPromptOf } from './prompt';
import { checkOwnPrompt } from './push';
import { type LlamaStateLayout, parseSeqState } from './seq-state';

/**
 * A state as its envelope holds it: what the envelope says, the state (a
 * copy, in a buffer lent by m.buffers: its holder gives it back) and its tokens.
 */
export type OpenedState = Continuation & { state: Buffer; tokens: number[] };

/**
 * The state in the blocks, checked: the envelope (model, size, MAC, the
 * request it is for), then every byte of the state for this model and
 * context; a push decode's (binding.ownPrompt) must hold its own prompt
 * (`req`). Throws KvRejected (the buffer given back); llama.cpp has seen nothing.
 */
export function openState(m: LoadedLlama, kv: KvInput, req?: GenerationRequest): OpenedState {
  const { binding } = kv;
  if (!binding) throw new KvRejected('no request to check the KV state against', 'wrong-request');
  const layout = m.layout;
  if (typeof layout === 'string')
    throw new KvRejected(`this decode cannot check KV states of ${m.id}: ${layout}`, 'unsupported');
  const opened = openEnvelope((i) => kv.view(i, 0), {
    blocks: kv.blocks,
    blockBytes: m.o.blockBytes,
    fingerprint: m.fingerprint,
    binding,
    secret: m.o.kvSecret,
    maxTokens: m.contextSize,
    maxStateBytes: m.o.poolBytes - HEADER_BYTES,
    into: m.buffers,
  });
  try {
    return { ...opened, tokens: checkState(m, layout, opened, kv, req) };
  } catch (e) {
    m.buffers.give(opened.state);
    throw e;
  }
}

/** The state's own bytes, for this model and context and for what its envelope says: its tokens. */
function checkState(
  m: LoadedLlama,
  layout: LlamaStateLayout,
  opened: Continuation & { state: Buffer },
  kv: KvInput,
  req: GenerationRequest | undefined,
): number[] {
  const parsed = parseSeqState(opened.state, layout);
  if (parsed.tokens.length !== opened.promptTokens)
    throw new KvRejected(
      `the KV state holds ${parsed.tokens.length} tokens, its envelope says ${opened.promptTokens}`,
      'malformed',
    );
  if (kv.binding?.ownPrompt) {
    const own = req && pushPromptOf(m, req);
    checkOwnPrompt(parsed.tokens, typeof own === 'string' ? undefined : own);
  }
  const f = opened.nextToken;
  if (f !== undefined && f >= layout.nVocab)
    throw new KvRejected(`the next token ${f} is outside the vocabulary of ${layout.nVocab}`, 'malformed');
  return parsed.tokens;
}

/**
 * A saved state as KV for blocks: the blocks its envelope takes, and how to
 * write it bound to a request. `state` is a buffer lent by m.buffers (a save,
 * state-file.ts): writeTo seals it into the blocks and gives it back, so it
 * runs once; a second call is an error, never a seal of whatever the buffer
 * holds by then.
 */
export function sealState(
  m: LoadedLlama,
  state: Buffer,
  info: Omit<StateInfo, 'binding'>,
): Pick<TurnKvState, 'blocks' | 'writeTo'> {
  const { blockBytes, kvSecret } = m.o;
  let sealed = false;
  return {
    blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
    writeTo: (view, binding: KvBinding) => {
      if (sealed) throw new NixlError('this KV state was written to its blocks already', 'NIXL_ERR_INVALID_PARAM');
      sealed = true;
      try {
        writeEnvelope(stateHeader(state, { ...info, binding }, kvSecret), state, blockBytes, (i) => view(i, 0));
      } finally {
        m.buffers.give(state);
      }
    },
  };
}
