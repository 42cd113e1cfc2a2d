// The wire format, in one file: vLLM NixlConnector's handshake messages,
// byte-compatible with what vLLM (msgspec) puts on the wire.
//
//   NixlHandshakePayload = msgpack map {compatibility_hash: str, agent_metadata_bytes: bin}
//   agent_metadata_bytes = msgpack map NixlAgentMetadata {engine_id, agent_metadata (bin),
//       kv_caches_base_addr [uint], device_id, num_blocks, block_lens [uint],
//       kv_cache_layout 'HND'|'NHD', block_size}
//   ZMQ request          = msgpack [b"get_meta_msg", tp_rank]  (or [msg, pp_rank, tp_rank],
//                          or the bare bytes b"get_meta_msg" of the per-rank-port form)
//
// Encoding is our own minimal msgpack writer (smallest int/str/bin/array/map
// headers, keys in field order: exactly msgspec's output); 64-bit addresses
// travel as uint64, never float64. Decoding uses msgpackr, then checks every
// field's type.
import { createHash } from 'node:crypto';
import { Unpackr } from 'msgpackr';
import { NixlError } from '../errors';

export const GET_META_MSG = Buffer.from('get_meta_msg');

export type KvCacheLayout = 'HND' | 'NHD';

/** vLLM's NixlAgentMetadata. */
export interface NixlAgentMetadata {
  engineId: string;
  agentMetadata: Buffer;
  kvCachesBaseAddr: bigint[];
  deviceId: number;
  numBlocks: number;
  blockLens: number[];
  kvCacheLayout: KvCacheLayout;
  blockSize: number;
}

/** vLLM's NixlHandshakePayload, with the inner metadata still encoded. */
export interface HandshakePayload {
  compatibilityHash: string;
  agentMetadataBytes: Buffer;
}

export class HandshakeError extends NixlError {
  constructor(message: string, code: string = 'NIXL_ERR_INVALID_PARAM', options?: { cause?: unknown }) {
    super(message, code, undefined, options);
    this.name = 'HandshakeError';
  }
}

// ---- msgpack writer ---------------------------------------------------------

type MpValue = string | number | bigint | boolean | null | Buffer | MpValue[] | Map<string, MpValue>;

class Writer {
  #chunks: Buffer[] = [];

  head(small: number, base: number, codes: [number, number, number], n: number): void {
    if (n < small) this.#chunks.push(Buffer.from([base | n]));
    else this.sized(codes, n);
  }

  sized(codes: [number, number, number], n: number): void {
    let b: Buffer;
    if (n < 0x100 && codes[0] !== 0) {
      b = Buffer.from([codes[0], n]);
    } else if (n < 0x10000) {
      b = Buffer.alloc(3);
      b[0] = codes[1];
      b.writeUInt16BE(n, 1);
    } else {
      b = Buffer.alloc(5);
      b[0] = codes[2];
      b.writeUInt32BE(n, 1);
    }
    this.#chunks.push(b);
  }

  int(v: bigint): void {
    let b: Buffer;
    if (v >= 0n) {
      if (v < 0x80n) b = Buffer.from([Number(v)]);
      else if (v < 0x100n) b = Buffer.from([0xcc, Number(v)]);
      else if (v < 0x10000n) {
        b = Buffer.alloc(3);
        b[0] = 0xcd;
        b.writeUInt16BE(Number(v), 1);
      } else if (v < 0x100000000n) {
        b = Buffer.alloc(5);
        b[0] = 0xce;
        b.writeUInt32BE(Number(v), 1);
      } else if (v < 1n << 64n) {
        b = Buffer.alloc(9);
        b[0] = 0xcf;
        b.writeBigUInt64BE(v, 1);
      } else throw new HandshakeError(`integer ${v} does not fit in uint64`);
    } else {
      if (v >= -32n) b = Buffer.from([Number(v) & 0xff]);
      else if (v >= -0x80n) {
        b = Buffer.alloc(2);
        b[0] = 0xd0;
        b.writeInt8(Number(v), 1);
      } else if (v >= -0x8000n) {
        b = Buffer.alloc(3);
        b[0] = 0xd1;
        b.writeInt16BE(Number(v), 1);
      } else if (v >= -0x80000000n) {
        b = Buffer.alloc(5);
        b[0] = 0xd2;
        b.writeInt32BE(Number(v), 1);
      } else if (v >= -(1n << 63n)) {
        b = Buffer.alloc(9);
        b[0] = 0xd3;
        b.writeBigInt64BE(v, 1);
      } else throw new HandshakeError(`integer ${v} does not fit in int64`);
    }
    this.#chunks.push(b);
  }

  value(v: MpValue): void {
    if (v === null) this.#chunks.push(Buffer.from([0xc0]));
    else if (v === true || v === false) this.#chunks.push(Buffer.from([v ? 0xc3 : 0xc2]));
    else if (typeof v === 'bigint') this.int(v);
    else if (typeof v === 'number') {
      if (!Number.isSafeInteger(v))
        throw new HandshakeError(`${v} is not an integer the wire format can carry exactly`);
      this.int(BigInt(v));
    } else if (typeof v === 'string') {
      const s = Buffer.from(v, 'utf8');
      this.head(32, 0xa0, [0xd9, 0xda, 0xdb], s.length);
      this.#chunks.push(s);
    } else if (Buffer.isBuffer(v)) {
      this.sized([0xc4, 0xc5, 0xc6], v.length);
      this.#chunks.push(v);
    } else if (Array.isArray(v)) {
      this.head(16, 0x90, [0, 0xdc, 0xdd], v.length);
      for (const x of v) this.value(x);
    } else {
      this.head(16, 0x80, [0, 0xde, 0xdf], v.size);
      for (const [k, x] of v) {
        this.value(k);
        this.value(x);
      }
    }
  }

  done(): Buffer {
    return Buffer.concat(this.#chunks);
  }
}

/** msgpack of a value built from strings, ints (number/bigint), Buffers, arrays and Maps. */
export function packMsgpack(v: MpValue): Buffer {
  const w = new Writer();
  w.value(v);
  return w.done();
}

// ---- msgpack reader ---------------------------------------------------------

const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'bigint' });

export function unpackMsgpack(buf: Uint8Array, what: string): unknown {
  try {
    return unpackr.unpack(Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength));
  } catch (e) {
    throw new HandshakeError(`${what}: not valid msgpack (${(e as Error).message})`, 'NIXL_ERR_INVALID_PARAM', {
      cause: e,
    });
  }
}

function field<T>(
  obj: Record<string, unknown>,
  key: string,
  what: string,
  check: (v: unknown) => T | undefined,
  expected: string,
): T {
  if (!(key in obj)) throw new HandshakeError(`${what}: missing key '${key}'`);
  const v = check(obj[key]);
  if (v === undefined) throw new HandshakeError(`${what}: key '${key}' must be ${expected}, got ${describe(obj[key])}`);
  return v;
}

function describe(v: unknown): string {
  if (v === null) return 'nil';
  if (Array.isArray(v)) return 'an array';
  if (v instanceof Uint8Array) return 'bytes';
  return typeof v;
}

const asStr = (v: unknown) => (typeof v === 'string' ? v : undefined);
const asBin = (v: unknown) => (v instanceof Uint8Array ? Buffer.from(v.buffer, v.byteOffset, v.byteLength) : undefined);
const UINT64_END = 1n << 64n;
// An address: a uint64 (msgpack uint 64 decodes to a bigint) or an exact
// number. A float64 past 2^53 is no exact address, and a bigint extension may
// carry values past 2^64 that a BigUint64Array would silently wrap.
const asUint64 = (v: unknown): bigint | undefined => {
  if (typeof v === 'bigint') return v >= 0n && v < UINT64_END ? v : undefined;
  if (typeof v === 'number' && Number.isSafeInteger(v) && v >= 0) return BigInt(v);
  return undefined;
};
const asSmallUint = (v: unknown): number | undefined => {
  const b = asUint64(v);
  return b !== undefined && b <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(b) : undefined;
};
const asList =
  <T>(el: (v: unknown) => T | undefined) =>
  (v: unknown): T[] | undefined => {
    if (!Array.isArray(v)) return undefined;
    const out: T[] = [];
    for (const x of v) {
      const y = el(x);
      if (y === undefined) return undefined;
      out.push(y);
    }
    return out;
  };
const asMap = (v: unknown): Record<string, unknown> | undefined =>
  typeof v === 'object' && v !== null && !Array.isArray(v) && !(v instanceof Uint8Array)
    ? (v as Record<string, unknown>)
    : undefined;

// ---- NixlAgentMetadata ------------------------------------------------------

export function encodeAgentMetadata(m: NixlAgentMetadata): Buffer {
  if (m.kvCacheLayout !== 'HND' && m.kvCacheLayout !== 'NHD')
    throw new HandshakeError(`kv_cache_layout must be 'HND' or 'NHD'`);
  return packMsgpack(
    new Map<string, MpValue>([
      ['engine_id', m.engineId],
      ['agent_metadata', Buffer.from(m.agentMetadata)],
      [
        'kv_caches_base_addr',
        m.kvCachesBaseAddr.map((a, i) => {
          const v = asUint64(a);
          if (v === undefined) throw new HandshakeError(`kv_caches_base_addr[${i}] = ${String(a)} is not a uint64`);
          return v;
        }),
      ],
      ['device_id', m.deviceId],
      ['num_blocks', m.numBlocks],
      ['block_lens', m.blockLens],
      ['kv_cache_layout', m.kvCacheLayout],
      ['block_size', m.blockSize],
    ]),
  );
}

export function decodeAgentMetadata(buf: Uint8Array): NixlAgentMetadata {
  const what = 'NixlAgentMetadata';
  const o = asMap(unpackMsgpack(buf, what));
  if (!o) throw new HandshakeError(`${what}: expected a msgpack map`);
  const layout = field(o, 'kv_cache_layout', what, asStr, 'a string');
  if (layout !== 'HND' && layout !== 'NHD')
    throw new HandshakeError(`${what}: kv_cache_layout must be 'HND' or 'NHD', got '${layout}'`);
  return {
    engineId: field(o, 'engine_id', what, asStr, 'a string'),
    agentMetadata: field(o, 'agent_metadata', what, asBin, 'bytes'),
    kvCachesBaseAddr: field(o, 'kv_caches_base_addr', what, asList(asUint64), 'a list of uint64 addresses'),
    deviceId: field(o, 'device_id', what, asSmallUint, 'an unsigned integer'),
    numBlocks: field(o, 'num_blocks', what, asSmallUint, 'an unsigned integer'),
    blockLens: field(o, 'block_lens', what, asList(asSmallUint), 'a list of unsigned integers'),
    kvCacheLayout: layout,
    blockSize: field(o, 'block_size', what, asSmallUint, 'an unsigned integer'),
  };
}

// ---- NixlHandshakePayload ---------------------------------------------------

export function encodeHandshakePayload(p: HandshakePayload): Buffer {
  return packMsgpack(
    new Map<string, MpValue>([
      ['compatibility_hash', p.compatibilityHash],
      ['agent_metadata_bytes', Buffer.from(p.agentMetadataBytes)],
    ]),
  );
}

export function decodeHandshakePayload(buf: Uint8Array): HandshakePayload {
  const what = 'NixlHandshakePayload';
  const o = asMap(unpackMsgpack(buf, what));
  if (!o) throw new HandshakeError(`${what}: expected a msgpack map`);
  if (typeof o.error === 'string')
    throw new HandshakeError(`peer answered with an error: ${o.error}`, 'NIXL_ERR_NOT_FOUND');
  return {
    compatibilityHash: field(o, 'compatibility_hash', what, asStr, 'a string'),
    agentMetadataBytes: field(o, 'agent_metadata_bytes', what, asBin, 'bytes'),
  };
}

/** Checks the hash (unless expected is undefined) and decodes the inner metadata. */
export function openHandshakePayload(p: HandshakePayload, expectedHash: string | undefined): NixlAgentMetadata {
  if (expectedHash !== undefined && p.compatibilityHash !== expectedHash) {
    throw new HandshakeError(
      `compatibility hash mismatch: remote ${p.compatibilityHash}, local ${expectedHash} ` +
        '(different vLLM/connector version, model, dtype or attention backend)',
      'NIXL_ERR_MISMATCH',
    );
  }
  return decodeAgentMetadata(p.agentMetadataBytes);
}

// ---- ZMQ request ------------------------------------------------------------

export interface MetaRequest {
  tpRank: number | undefined; // undefined: the bare per-rank-port form
  ppRank?: number;
}

export function encodeMetaRequest(tpRank: number, ppRank?: number): Buffer {
  return packMsgpack(ppRank === undefined ? [GET_META_MSG, tpRank] : [GET_META_MSG, ppRank, tpRank]);
}

export function decodeMetaRequest(buf: Uint8Array): MetaRequest {
  if (Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength).equals(GET_META_MSG)) return { tpRank: undefined };
  const v = unpackMsgpack(buf, 'handshake request');
  if (!Array.isArray(v) || (v.length !== 2 && v.length !== 3)) {
    throw new HandshakeError('handshake request: expected [get_meta_msg, tp_rank] or [get_meta_msg, pp_rank, tp_rank]');
  }
  const msg = v[0];
  const isGet = (msg instanceof Uint8Array && Buffer.from(msg).equals(GET_META_MSG)) || msg === 'get_meta_msg';
  if (!isGet)
    throw new HandshakeError(`handshake request: unknown message ${JSON.stringify(String(msg)).slice(0, 64)}`);
  const tp = asSmallUint(v[v.length - 1]);
  if (tp === undefined) throw new HandshakeError('handshake request: tp_rank must be an unsigned integer');
  const pp = v.length === 3 ? asSmallUint(v[1]) : undefined;
  if (v.length === 3 && pp === undefined)
    throw new HandshakeError('handshake request: pp_rank must be an unsigned integer');
  return { tpRank: tp, ppRank: pp };
}

// ---- compatibility hash -----------------------------------------------------

export type HashFactor = string | number | boolean | null | HashFactor[] | { [k: string]: HashFactor };

/** Python's json.dumps(v, sort_keys=True): ', ' and ': ' separators, ASCII-only escapes. */
export function pyJsonDumps(v: HashFactor): string {
  if (v === null) return 'null';
  if (v === true) return 'true';
  if (v === false) return 'false';
  if (typeof v === 'number') return pyNumber(v);
  if (typeof v === 'string') return pyString(v);
  if (Array.isArray(v)) return `[${v.map(pyJsonDumps).join(', ')}]`;
  const keys = Object.keys(v).sort(pyCompare);
  return `{${keys.map((k) => `${pyString(k)}: ${pyJsonDumps(v[k])}`).join(', ')}}`;
}

// Python sorts str by code point; JS sort() by UTF-16 unit.
function pyCompare(a: string, b: string): number {
  const x = [...a].map((c) => c.codePointAt(0)!);
  const y = [...b].map((c) => c.codePointAt(0)!);
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

function pyNumber(n: number): string {
  if (Number.isInteger(n) && Math.abs(n) < 1e16) return String(n);
  if (Number.isNaN(n)) return 'NaN';
  if (!Number.isFinite(n)) return n > 0 ? 'Infinity' : '-Infinity';
  // float repr: shortest round-trip digits, exponent with at least two digits.
  let s = String(n);
  if (Math.abs(n) >= 1e16 && !s.includes('e')) s = n.toExponential();
  s = s.replace(/e([+-])(\d)$/, 'e$10$2');
  if (!s.includes('.') && !s.includes('e')) s += '.0';
  return s;
}

function pyString(s: string): string {
  let out = '"';
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c === 0x22) out += '\\"';
    else if (c === 0x5c) out += '\\\\';
    else if (c === 0x0a) out += '\\n';
    else if (c === 0x0d) out += '\\r';
    else if (c === 0x09) out += '\\t';
    else if (c === 0x08) out += '\\b';
    else if (c === 0x0c) out += '\\f';
    else if (c < 0x20 || c > 0x7e) out += `\\u${c.toString(16).padStart(4, '0')}`;
    else out += s[i];
  }
  return `${out}"`;
}

/** vLLM's hash_factors: sha256(json.dumps(factors, sort_keys=True)).hexdigest(). */
export function hashFactors(factors: { [k: string]: HashFactor }): string {
  return createHash('sha256').update(pyJsonDumps(factors), 'utf8').digest('hex');
}

/** The factors vLLM's compute_nixl_compatibility_hash uses. */
export interface CompatibilityFactors {
  vllmVersion: string;
  nixlConnectorVersion?: number; // vLLM's NIXL_CONNECTOR_VERSION (2 in v0.13)
  model: string;
  dtype: string; // e.g. 'torch.bfloat16'
  numKvHeads: number;
  headSize: number;
  numHiddenLayers: number;
  attnBackendName: string;
  cacheDtype: string; // e.g. 'auto'
}

const FACTOR_TYPES: Record<keyof CompatibilityFactors, 'string' | 'number'> = {
  vllmVersion: 'string',
  nixlConnectorVersion: 'number',
  model: 'string',
  dtype: 'string',
  numKvHeads: 'number',
  headSize: 'number',
  numHiddenLayers: 'number',
  attnBackendName: 'string',
  cacheDtype: 'string',
};

export function computeCompatibilityHash(f: CompatibilityFactors): string {
  if (typeof f !== 'object' || f === null)
    throw new HandshakeError('computeCompatibilityHash expects the factors object');
  for (const [k, t] of Object.entries(FACTOR_TYPES)) {
    const v = (f as unknown as Record<string, unknown>)[k];
    if (v === undefined && k === 'nixlConnectorVersion') continue;
    if (typeof v !== t || (t === 'number' && !Number.isInteger(v))) {
      throw new HandshakeError(
        `computeCompatibilityHash: factor '${k}' must be ${t === 'number' ? 'an integer' : 'a string'}, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`,
      );
    }
  }
  return hashFactors({
    vllm_version: f.vllmVersion,
    nixl_connector_version: f.nixlConnectorVersion ?? 2,
    model: f.model,
    dtype: f.dtype,
    num_kv_heads: f.numKvHeads,
    head_size: f.headSize,
    num_hidden_layers: f.numHiddenLayers,
    attn_backend_name: f.attnBackendName,
    cache_dtype: f.cacheDtype,
  });
}
