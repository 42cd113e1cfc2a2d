// vLLM's NixlHandshakePayload envelope, the same in both wire profiles, and
// the request a side channel answers with it.
import { HandshakeError } from './errors';
import { type FieldSpec, decodeFields, encodeFields } from './fields';
import { packMsgpack, unpackMsgpack } from './msgpack';

/** The request a vLLM side channel answers with its handshake payload. */
export const GET_META_MSG = Buffer.from('get_meta_msg');

/** vLLM's NixlHandshakePayload, with the inner metadata still encoded. */
export interface HandshakePayload {
  compatibilityHash: string;
  agentMetadataBytes: Buffer;
}

// ---- NixlHandshakePayload ---------------------------------------------------

// The same envelope in both profiles (vLLM's NixlHandshakePayload).
const PAYLOAD_FIELDS: readonly FieldSpec[] = [
  { key: 'compatibility_hash', prop: 'compatibilityHash', type: 'str', required: true },
  { key: 'agent_metadata_bytes', prop: 'agentMetadataBytes', type: 'bin', required: true },
];

/** Encodes vLLM's NixlHandshakePayload. */
export function encodeHandshakePayload(p: HandshakePayload): Buffer {
  return packMsgpack(encodeFields(PAYLOAD_FIELDS, p as unknown as Record<string, unknown>, 'NixlHandshakePayload'));
}

/** Decodes vLLM's NixlHandshakePayload; an error reply from the side channel throws HandshakeError. */
export function decodeHandshakePayload(buf: Uint8Array): HandshakePayload {
  const what = 'NixlHandshakePayload';
  const o = unpackMsgpack(buf, what) as Record<string, unknown>;
  if (typeof o === 'object' && o !== null && typeof o.error === 'string') {
    const code = typeof o.code === 'string' && /^NIXL_ERR_[A-Z_]+$/.test(o.code) ? o.code : 'NIXL_ERR_NOT_FOUND';
    throw new HandshakeError(`peer answered with an error: ${o.error}`, code);
  }
  const p = decodeFields(PAYLOAD_FIELDS, o, what);
  return { compatibilityHash: p.compatibilityHash as string, agentMetadataBytes: p.agentMetadataBytes as Buffer };
}
