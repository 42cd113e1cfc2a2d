// A GGUF's KV in blocks: its sequence state in the envelope of kv-state.ts.
// Sealing wraps a state a prefill (or a decode holding a turn) saved, bound
// to the request whose blocks it goes into; opening checks the envelope, then
// every byte of the state for this model and context (seq-state.ts), before
// llama.cpp sees one.
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
import { parseSeqState } from './seq-state';

/** A state as its envelope holds it: what the envelope says, the state (a copy) and its tokens. */
export type OpenedState = Continuation & { state: Buffer; tokens: number[] };

/**
 * The state in the blocks, checked: the envelope (model, size, MAC, the
 * request it is for), then every byte of the state for this model and
 * context; a push decode's (binding.ownPrompt) must hold its own prompt
 * (`req`). Throws KvRejected; llama.cpp has seen nothing.
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
  });
  const parsed = parseSeqState(opened.state, layout);
  if (parsed.tokens.length !== opened.promptTokens)
    throw new KvRejected(
      `the KV state holds ${parsed.tokens.length} tokens, its envelope says ${opened.promptTokens}`,
      'malformed',
    );
  if (binding.ownPrompt) {
    const own = req && pushPromptOf(m, req);
    checkOwnPrompt(parsed.tokens, typeof own === 'string' ? undefined : own);
  }
  const f = opened.nextToken;
  if (f !== undefined && f >= layout.nVocab)
    throw new KvRejected(`the next token ${f} is outside the vocabulary of ${layout.nVocab}`, 'malformed');
  return { ...opened, tokens: parsed.tokens };
}

/** A saved state as KV for blocks: the blocks its envelope takes, and how to write it bound to a request. */
export function sealState(
  m: LoadedLlama,
  state: Buffer,
  info: Omit<StateInfo, 'binding'>,
): Pick<TurnKvState, 'blocks' | 'writeTo'> {
  const { blockBytes, kvSecret } = m.o;
  return {
    blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
    writeTo: (view, binding: KvBinding) =>
      writeEnvelope(stateHeader(state, { ...info, binding }, kvSecret), state, blockBytes, (i) => view(i, 0)),
  };
}
