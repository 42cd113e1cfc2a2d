// The field-table codec that the wire profiles (wire-v0.13.ts, wire-v12.ts)
// describe their maps with: one table encodes, decodes, checks types and
// converts to JSON.
import { HandshakeError } from './errors';
import { Float64, type MpValue } from './msgpack';

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
