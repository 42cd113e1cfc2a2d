// What the KV-state envelope tests share: the model fingerprint and request
// binding a state is sealed for, and the options that open it again.
import { createHash } from 'node:crypto';

export const FP = createHash('sha256').update('model a').digest();
export const BIND = { engineId: 'prefill-1', requestId: 'kv-1-abc', blockIds: [4, 5, 6] };

/** openEnvelope's options for `blocks` blocks of `blockBytes`, bound to FP and BIND. */
export const envelopeOptions = (blocks: number, blockBytes: number, maxStateBytes: number, secret?: string) => ({
  blocks,
  blockBytes,
  fingerprint: FP,
  binding: BIND,
  secret,
  maxTokens: 4096,
  maxStateBytes,
});
