// Signed kv_transfer_params (beyond vLLM, which trusts them): with a secret
// shared by a deployment's prefills and decodes, the prefill signs the fields
// that say what to read (engine, request, address, block ids, sizes, expiry,
// token count, and for a finished turn the digest of the tokens its KV is of)
// and a decode refuses params that are unsigned, forged, or name blocks the
// prefill did not give that request, before it handshakes or reads anything.
// Without a secret nothing changes, and vLLM peers never see the extra key.
import { createHmac, timingSafeEqual } from 'node:crypto';
import { NixlError } from '../errors';

/** The key the signature travels under in kv_transfer_params. */
export const SIGNATURE_KEY = 'nixl_node_signature';

/** What is signed, in a fixed order (missing fields as null). */
const FIELDS = [
  'remote_engine_id',
  'remote_request_id',
  'remote_host',
  'remote_port',
  'remote_block_ids',
  'tp_size',
  'pp_size',
  'dcp_size',
  'remote_blocks_expiry_time',
  'transfer_mode',
  'remote_num_tokens',
  // A decode's hold of a finished turn: which tokens its KV is of (turn-params.ts).
  'nixl_node_prefix_tokens',
  'nixl_node_prefix_sha256',
] as const;

function mac(params: Record<string, unknown>, secret: string | Buffer): Buffer {
  const body = JSON.stringify(FIELDS.map((f) => params[f] ?? null));
  return createHmac('sha256', secret).update('nixl-node kv_transfer_params v2\n').update(body).digest();
}

/** The params with their signature added (HMAC-SHA256, hex). */
export function signKvTransferParams<T extends Record<string, unknown>>(params: T, secret: string | Buffer): T {
  return { ...params, [SIGNATURE_KEY]: mac(params, secret).toString('hex') };
}

/** Throws NixlError NIXL_ERR_NOT_ALLOWED unless `params` carry a valid signature for `secret`. */
export function verifyKvTransferParams(params: Record<string, unknown>, secret: string | Buffer): void {
  const sig = params[SIGNATURE_KEY];
  if (typeof sig !== 'string')
    throw new NixlError(
      `kv_transfer_params are not signed ('${SIGNATURE_KEY}' missing) and this decode requires signed params`,
      'NIXL_ERR_NOT_ALLOWED',
    );
  const want = mac(params, secret);
  const got = /^[0-9a-f]{64}$/.test(sig) ? Buffer.from(sig, 'hex') : Buffer.alloc(0);
  if (got.length !== want.length || !timingSafeEqual(got, want))
    throw new NixlError(
      'kv_transfer_params signature does not match: forged or altered params, or another secret',
      'NIXL_ERR_NOT_ALLOWED',
    );
}
