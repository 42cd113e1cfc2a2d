// What both wire profiles share: a msgpack writer with msgspec's encoding
// (smallest int/str/bin/array/map headers, map keys in field order, 64-bit
// addresses as uint64, floats only where a field is a float), a strict
// reader, a field-table codec that the profiles (wire-v0.13.ts, wire-v12.ts)
// describe their maps with, the NixlHandshakePayload envelope, and Python's
// json.dumps for vLLM's compatibility hash.
import { createHash } from 'node:crypto';
import { NixlError } from '../errors';

/** The request a vLLM side channel answers with its handshake payload. */
export const GET_META_MSG = Buffer.from('get_meta_msg');

/** vLLM's NixlHandshakePayload, with the inner metadata still encoded. */
export interface HandshakePayload {
  compatibilityHash: string;
  agentMetadataBytes: Buffer;
}

/** A handshake that failed: a side channel refused, answered garbage, timed out or has another model. */
export class HandshakeError extends NixlError {
  constructor(message: string, code: string = 'NIXL_ERR_INVALID_PARAM', options?: { cause?: unknown }) {
    super(message, code, undefined, options);
    this.name = 'HandshakeError';
  }
}

// ---- msgpack writer ---------------------------------------------------------

/** A msgpack float64 (msgspec encodes a Python float as 0xcb even when it is whole). */
export class Float64 {
  constructor(readonly value: number) {}
}

/** A msgpack value as the codec reads and writes it (64-bit integers as bigint, floats tagged). */
export type MpValue = string | number | bigint | boolean | null | Buffer | Float64 | MpValue[] | Map<string, MpValue>;

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
    else if (v instanceof Float64) {
      const b = Buffer.alloc(9);
      b[0] = 0xcb;
      b.writeDoubleBE(v.value, 1);
      this.#chunks.push(b);
    } else if (typeof v === 'number') {
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
// Our own, not msgpackr: msgspec's typed decoder tells an int from a float
// (1 vs 1.0) and str from bin, and refuses trailing bytes; msgpackr turns
// 1.0 into 1, so a float where vLLM sends an int would pass unnoticed.
// Ints come back as numbers when exact, else as bigints (int64/uint64
// range); floats as Float64; maps as null-prototype objects with string keys.

const MAX_DEPTH = 32;

class Reader {
  #p = 0;
  constructor(private readonly b: Buffer) {}

  #need(n: number): void {
    if (this.#p + n > this.b.length) throw new Error(`truncated at byte ${this.#p}`);
  }

  #u8(): number {
    this.#need(1);
    return this.b[this.#p++];
  }

  #bytes(n: number): Buffer {
    this.#need(n);
    const out = this.b.subarray(this.#p, this.#p + n);
    this.#p += n;
    return out;
  }

  #uint(size: 1 | 2 | 4): number {
    this.#need(size);
    const v = size === 1 ? this.b[this.#p] : size === 2 ? this.b.readUInt16BE(this.#p) : this.b.readUInt32BE(this.#p);
    this.#p += size;
    return v;
  }

  #int(v: bigint): number | bigint {
    return v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
  }

  #str(n: number): string {
    const s = this.#bytes(n);
    const t = s.toString('utf8');
    if (!Buffer.from(t, 'utf8').equals(s)) throw new Error('a str that is not valid UTF-8');
    return t;
  }

  #array(n: number, depth: number): unknown[] {
    if (n > this.b.length - this.#p) throw new Error(`array of ${n} elements in ${this.b.length - this.#p} bytes`);
    const out: unknown[] = [];
    for (let i = 0; i < n; i++) out.push(this.value(depth + 1));
    return out;
  }

  #map(n: number, depth: number): Record<string, unknown> {
    if (n > this.b.length - this.#p) throw new Error(`map of ${n} entries in ${this.b.length - this.#p} bytes`);
    const out: Record<string, unknown> = Object.create(null);
    for (let i = 0; i < n; i++) {
      const k = this.value(depth + 1);
      if (typeof k !== 'string') throw new Error('a map key that is not a str');
      out[k] = this.value(depth + 1);
    }
    return out;
  }

  value(depth = 0): unknown {
    if (depth > MAX_DEPTH) throw new Error(`nested deeper than ${MAX_DEPTH}`);
    const c = this.#u8();
    if (c <= 0x7f) return c;
    if (c >= 0xe0) return c - 0x100;
    if ((c & 0xf0) === 0x80) return this.#map(c & 0x0f, depth);
    if ((c & 0xf0) === 0x90) return this.#array(c & 0x0f, depth);
    if ((c & 0xe0) === 0xa0) return this.#str(c & 0x1f);
    switch (c) {
      case 0xc0:
        return null;
      case 0xc2:
        return false;
      case 0xc3:
        return true;
      case 0xc4:
        return Buffer.from(this.#bytes(this.#uint(1)));
      case 0xc5:
        return Buffer.from(this.#bytes(this.#uint(2)));
      case 0xc6:
        return Buffer.from(this.#bytes(this.#uint(4)));
      case 0xca:
        this.#need(4);
        this.#p += 4;
        return new Float64(this.b.readFloatBE(this.#p - 4));
      case 0xcb:
        this.#need(8);
        this.#p += 8;
        return new Float64(this.b.readDoubleBE(this.#p - 8));
      case 0xcc:
        return this.#uint(1);
      case 0xcd:
        return this.#uint(2);
      case 0xce:
        return this.#uint(4);
      case 0xcf:
        this.#need(8);
        this.#p += 8;
        return this.#int(this.b.readBigUInt64BE(this.#p - 8));
      case 0xd0:
        this.#need(1);
        return this.b.readInt8(this.#p++);
      case 0xd1:
        this.#need(2);
        this.#p += 2;
        return this.b.readInt16BE(this.#p - 2);
      case 0xd2:
        this.#need(4);
        this.#p += 4;
        return this.b.readInt32BE(this.#p - 4);
      case 0xd3:
        this.#need(8);
        this.#p += 8;
        return this.#int(this.b.readBigInt64BE(this.#p - 8));
      case 0xd9:
        return this.#str(this.#uint(1));
      case 0xda:
        return this.#str(this.#uint(2));
      case 0xdb:
        return this.#str(this.#uint(4));
      case 0xdc:
        return this.#array(this.#uint(2), depth);
      case 0xdd:
        return this.#array(this.#uint(4), depth);
      case 0xde:
        return this.#map(this.#uint(2), depth);
      case 0xdf:
        return this.#map(this.#uint(4), depth);
      default:
        throw new Error(`type byte 0x${c.toString(16)} (ext types are not part of this format)`);
    }
  }

  end(): void {
    if (this.#p !== this.b.length) throw new Error(`${this.b.length - this.#p} trailing bytes`);
  }
}

/** Decodes one msgpack value; `what` names it in errors. Integers >= 2^64 are refused. */
export function unpackMsgpack(buf: Uint8Array, what: string): unknown {
  const r = new Reader(Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength));
  try {
    const v = r.value();
    r.end();
    return v;
  } catch (e) {
    throw new HandshakeError(`${what}: not valid msgpack (${(e as Error).message})`, 'NIXL_ERR_INVALID_PARAM', {
      cause: e,
    });
  }
}

// ---- field tables -----------------------------------------------------------
// A profile describes each map it sends as a table of fields; one codec
// encodes, decodes, checks types and converts to JSON from it.

/** The type of one field of a vLLM wire structure. */
export type FieldType =
  | 'str'
  | 'bin'
  | 'bool'
  | 'int' // any int64/uint64 that a JS number holds exactly
  | 'uint'
  | 'float' // a float, or an int (msgspec's float accepts both)
  | 'u64[]' // addresses: bigint
  | 'uint[]'
  | 'int[]'
  | 'uint[][]'
  | 'int2' // tuple[int, int]
  | 'str[]'
  | 'str[][]';

/** One field of a vLLM wire structure: its msgpack key, its property, its type. */
export interface FieldSpec {
  key: string;
  /** Property of the model object. */
  prop: string;
  type: FieldType;
  /** Absent from the wire: an error. Otherwise `default` is used. */
  required?: boolean;
  /** nil on the wire means null. */
  nullable?: boolean;
  default?: unknown;
  /** Added to a type error: which other format sends this shape. */
  hint?: string;
  /** Not written when it holds its default (a key of nixl-node's own, which vLLM peers need not see). */
  omitIfDefault?: boolean;
}

const UINT64_END = 1n << 64n;

/** Absent, or the field's default (an empty list for a list field). */
function isDefault(v: unknown, def: unknown): boolean {
  return v === undefined || v === def || (Array.isArray(v) && Array.isArray(def) && v.length === 0 && def.length === 0);
}

function describe(v: unknown): string {
  if (v === null) return 'nil';
  if (Array.isArray(v)) return `an array of ${v.length}`;
  if (v instanceof Uint8Array) return 'bin';
  if (v instanceof Float64) return `float ${v.value}`;
  if (typeof v === 'string') return `str ${JSON.stringify(v.length > 40 ? `${v.slice(0, 40)}...` : v)}`;
  if (typeof v === 'number' || typeof v === 'bigint') return `int ${v}`;
  if (typeof v === 'boolean') return `bool ${v}`;
  return typeof v;
}

const isInt = (v: unknown): v is number => typeof v === 'number' && Number.isSafeInteger(v);
const asUint64 = (v: unknown): bigint | undefined => {
  if (typeof v === 'bigint') return v >= 0n && v < UINT64_END ? v : undefined;
  if (isInt(v) && v >= 0) return BigInt(v);
  return undefined;
};
const listOf =
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
const asInt = (v: unknown) => (isInt(v) ? v : undefined);
const asUint = (v: unknown) => (isInt(v) && v >= 0 ? v : undefined);
const asStr = (v: unknown) => (typeof v === 'string' ? v : undefined);

const READERS: Record<FieldType, [(v: unknown) => unknown, string]> = {
  str: [asStr, 'a str'],
  bin: [(v) => (v instanceof Uint8Array ? Buffer.from(v.buffer, v.byteOffset, v.byteLength) : undefined), 'bin'],
  bool: [(v) => (typeof v === 'boolean' ? v : undefined), 'a bool'],
  int: [asInt, 'an int'],
  uint: [asUint, 'an unsigned int'],
  float: [(v) => (v instanceof Float64 ? v.value : isInt(v) ? v : undefined), 'a float'],
  'u64[]': [listOf(asUint64), 'an array of uint64 addresses'],
  'uint[]': [listOf(asUint), 'an array of unsigned ints'],
  'int[]': [listOf(asInt), 'an array of ints'],
  'uint[][]': [listOf(listOf(asUint)), 'an array of arrays of unsigned ints'],
  int2: [(v) => (Array.isArray(v) && v.length === 2 ? listOf(asInt)(v) : undefined), 'an array of exactly 2 ints'],
  'str[]': [listOf(asStr), 'an array of str'],
  'str[][]': [listOf(listOf(asStr)), 'an array of arrays of str'],
};

/** Reads one map by its table: missing required keys and type mismatches name the key and what came. */
export function decodeFields(fields: readonly FieldSpec[], o: unknown, what: string): Record<string, unknown> {
  if (typeof o !== 'object' || o === null || Array.isArray(o) || o instanceof Uint8Array || o instanceof Float64)
    throw new HandshakeError(`${what}: expected a map, got ${describe(o)}`);
  const m = o as Record<string, unknown>;
  const out: Record<string, unknown> = {};
  for (const f of fields) {
    if (!Object.hasOwn(m, f.key)) {
      if (f.required)
        throw new HandshakeError(`${what}: missing required field '${f.key}'${f.hint ? ` (${f.hint})` : ''}`);
      if (f.omitIfDefault) continue; // left out, as it was sent
      out[f.prop] = structuredClone(f.default);
      continue;
    }
    const v = m[f.key];
    if (v === null && f.nullable) {
      out[f.prop] = null;
      continue;
    }
    const [read, expected] = READERS[f.type];
    const got = read(v);
    if (got === undefined)
      throw new HandshakeError(
        `${what}: field '${f.key}' must be ${expected}${f.nullable ? ' or nil' : ''}, got ${describe(v)}${f.hint ? ` (${f.hint})` : ''}`,
      );
    out[f.prop] = got;
  }
  return out;
}

/** Writes one map by its table, keys in table order (msgspec's field order). */
export function encodeFields(
  fields: readonly FieldSpec[],
  obj: Record<string, unknown>,
  what: string,
): Map<string, MpValue> {
  const out = new Map<string, MpValue>();
  for (const f of fields) {
    let v = obj[f.prop];
    if (f.omitIfDefault && isDefault(v, f.default)) continue;
    if (v === undefined) {
      if (f.required && f.default === undefined) throw new HandshakeError(`${what}: '${f.prop}' is required`);
      v = f.default ?? null;
    }
    if (v === null) {
      if (!f.nullable) throw new HandshakeError(`${what}: '${f.prop}' must not be null`);
      out.set(f.key, null);
      continue;
    }
    const [read, expected] = READERS[f.type];
    const ok = f.type === 'float' ? typeof v === 'number' && Number.isFinite(v) : read(v) !== undefined;
    if (!ok) throw new HandshakeError(`${what}: '${f.prop}' must be ${expected}, got ${describe(v)}`);
    out.set(f.key, toWire(f.type, v));
  }
  return out;
}

function toWire(t: FieldType, v: unknown): MpValue {
  if (t === 'bin') return Buffer.from(v as Uint8Array);
  if (t === 'float') return new Float64(v as number);
  if (t === 'u64[]') return (v as Array<bigint | number>).map((a) => BigInt(a));
  return v as MpValue;
}

/** The same table as JSON: bin as base64, addresses past 2^53 as decimal strings, nil as null. */
export function fieldsToJson(fields: readonly FieldSpec[], obj: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const f of fields) {
    if (f.omitIfDefault && isDefault(obj[f.prop], f.default)) continue;
    const v = obj[f.prop] ?? (f.default === undefined ? null : f.default);
    if (v === null) out[f.key] = null;
    else if (f.type === 'bin') out[f.key] = Buffer.from(v as Uint8Array).toString('base64');
    else if (f.type === 'u64[]')
      out[f.key] = (v as bigint[]).map((a) => (a <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(a) : a.toString()));
    else out[f.key] = v;
  }
  return out;
}

/** Reads fieldsToJson's output back, with decodeFields' checks. */
export function fieldsFromJson(fields: readonly FieldSpec[], o: unknown, what: string): Record<string, unknown> {
  if (typeof o !== 'object' || o === null || Array.isArray(o))
    throw new HandshakeError(`${what}: expected a JSON object`);
  const src = o as Record<string, unknown>;
  const m: Record<string, unknown> = Object.create(null);
  for (const [k, v] of Object.entries(src)) m[k] = v;
  for (const f of fields) {
    if (!Object.hasOwn(m, f.key) || m[f.key] === null) continue;
    const v = m[f.key];
    if (f.type === 'bin') {
      if (typeof v !== 'string' || !/^[A-Za-z0-9+/]*={0,2}$/.test(v))
        throw new HandshakeError(`${what}: field '${f.key}' must be base64, got ${describe(v)}`);
      m[f.key] = Buffer.from(v, 'base64');
    } else if (f.type === 'u64[]' && Array.isArray(v)) {
      m[f.key] = v.map((a) => (typeof a === 'string' && /^\d{1,20}$/.test(a) ? BigInt(a) : a));
    } else if (f.type === 'float' && typeof v === 'number' && !Number.isInteger(v)) {
      m[f.key] = new Float64(v);
    }
  }
  return decodeFields(fields, m, what);
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

// ---- compatibility hash -----------------------------------------------------

/** A factor of vLLM's compatibility hash (JSON-like). */
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
