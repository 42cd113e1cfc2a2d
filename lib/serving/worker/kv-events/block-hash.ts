// vLLM's `sha256_cbor` block-hash chain (prefix_caching_hash_algo
// sha256_cbor): H_i = sha256(canonical CBOR of [H_{i-1} or NONE_HASH,
// tokens of block i, extra keys or null]), NONE_HASH = sha256(CBOR of the
// seed string). Unlike vLLM's default (pickle) it can be reproduced outside
// Python, so every worker of a deployment announces the same hash for the
// same prefix, across restarts. On the wire a hash is its last 8 bytes,
// big-endian, as an unsigned 64-bit int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
import { createHash } from 'node:crypto';
import { NixlError } from '../../../errors';

/** vLLM's seed when PYTHONHASHSEED is not set (sha256 / sha256_cbor). */
export const DEFAULT_HASH_SEED = 'vllm-none-hash';

/** What the chain hashes: ints, text, bytes, arrays of them, null. */
export type CborValue = number | bigint | string | Buffer | null | readonly CborValue[];

function head(major: number, n: number | bigint, out: Buffer[]): void {
  const v = BigInt(n);
  const m = major << 5;
  if (v < 24n) out.push(Buffer.from([m | Number(v)]));
  else if (v < 0x100n) out.push(Buffer.from([m | 24, Number(v)]));
  else if (v < 0x10000n) {
    const b = Buffer.alloc(3);
    b[0] = m | 25;
    b.writeUInt16BE(Number(v), 1);
    out.push(b);
  } else if (v < 0x100000000n) {
    const b = Buffer.alloc(5);
    b[0] = m | 26;
    b.writeUInt32BE(Number(v), 1);
    out.push(b);
  } else if (v < 1n << 64n) {
    const b = Buffer.alloc(9);
    b[0] = m | 27;
    b.writeBigUInt64BE(v, 1);
    out.push(b);
  } else throw new NixlError(`integer ${n} does not fit CBOR`, 'NIXL_ERR_INVALID_PARAM');
}

function encode(v: CborValue, out: Buffer[]): void {
  if (v === null) out.push(Buffer.from([0xf6]));
  else if (typeof v === 'number' || typeof v === 'bigint') {
    if (typeof v === 'number' && !Number.isSafeInteger(v))
      throw new NixlError(`${v} is not an integer`, 'NIXL_ERR_INVALID_PARAM');
    const b = BigInt(v);
    if (b >= 0n) head(0, b, out);
    else head(1, -1n - b, out);
  } else if (typeof v === 'string') {
    const s = Buffer.from(v, 'utf8');
    head(3, s.length, out);
    out.push(s);
  } else if (Buffer.isBuffer(v)) {
    head(2, v.length, out);
    out.push(v);
  } else {
    head(4, v.length, out);
    for (const x of v) encode(x, out);
  }
}

/**
 * Canonical (RFC 8949 core deterministic) CBOR of the values the chain
 * hashes: shortest heads, definite lengths. Floats and maps never occur in a
 * block's hash input, so they are not encoded.
 */
export function canonicalCbor(v: CborValue): Buffer {
  const out: Buffer[] = [];
  encode(v, out);
  return Buffer.concat(out);
}

/** vLLM's sha256_cbor. */
export function sha256Cbor(v: CborValue): Buffer {
  return createHash('sha256').update(canonicalCbor(v)).digest();
}

/** The chain's root: the hash of the seed (PYTHONHASHSEED, or vLLM's default seed). */
export function noneHash(seed: string = DEFAULT_HASH_SEED): Buffer {
  return sha256Cbor(seed);
}

/** A hash as events carry it: its last 8 bytes, big-endian, unsigned. */
export function wireHash(digest: Buffer): bigint {
  return digest.readBigUInt64BE(digest.length - 8);
}

/**
 * The digests of the full blocks of `tokens` (a partial last block is not
 * hashed), from block 0. `extraKeys(i)`: block i's extra keys (LoRA name,
 * cache salt...) or null.
 */
export function blockDigests(
  tokens: readonly number[],
  blockSize: number,
  root: Buffer,
  extraKeys: (i: number) => readonly CborValue[] | null = () => null,
): Buffer[] {
  const out: Buffer[] = [];
  let parent = root;
  for (let i = 0; (i + 1) * blockSize <= tokens.length; i++) {
    parent = sha256Cbor([parent, tokens.slice(i * blockSize, (i + 1) * blockSize), extraKeys(i)]);
    out.push(parent);
  }
  return out;
}
