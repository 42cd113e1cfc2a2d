// Decoder of vLLM's KV-cache EventBatch (docs/kv-events.md): the outer batch
// as an array of 2 or 3 or a map, each event as a map (vLLM >= #42892) or a
// positional array (older vLLM, SGLang), mixed in one batch. Block hashes
// come as uint64, int64 (bits reinterpreted) or bin (last 8 bytes
// big-endian, as llm-d reads them). Anything malformed is refused with a
// reason the caller counts, never thrown past this file.
import { Unpackr } from 'msgpackr';

/** One event, normalised. Hashes are unsigned 64-bit values as bigint. */
export type KvEvent =
  | {
      type: 'BlockStored';
      blockHashes: bigint[];
      parent: bigint | null;
      /** All tokens of the new blocks; empty when the event carries none (offload tiers). */
      tokenIds: number[];
      blockSize: number;
      medium: string | null;
      loraName: string | null;
    }
  | { type: 'BlockRemoved'; blockHashes: bigint[]; medium: string | null }
  | { type: 'AllBlocksCleared' };

/** Limits on what one batch may carry: past them the event (or the batch) is dropped and counted. */
export interface DecodeLimits {
  /** Events in one batch (default 100,000). */
  maxEvents?: number;
  /** Hashes in one event (default 65,536). */
  maxBlocks?: number;
  /** Tokens per block (default 4096). */
  maxBlockSize?: number;
}

export interface DecodedBatch {
  ts: number;
  dpRank: number | null;
  events: KvEvent[];
  /** Events dropped, by reason (unknown type, wrong types, over a limit). */
  dropped: Record<string, number>;
}

/** A batch that cannot be read at all. */
export class BatchRefused extends Error {
  readonly code = 'NIXL_ERR_KV_EVENT_BATCH';
}

// Maps as Map (no object prototype from hostile keys), 64-bit ints as bigint.
const unpackr = new Unpackr({ mapsAsObjects: false, useRecords: false, int64AsType: 'bigint' } as never);

const U64 = (1n << 64n) - 1n;
const I64_MIN = -(1n << 63n);

/** A block hash as an unsigned 64-bit value, or undefined when it is none of uint64, int64, bin. */
export function hashValue(v: unknown): bigint | undefined {
  // A uint64 (the usual hash) is returned as it is: asUintN makes a new BigInt.
  if (typeof v === 'bigint') return v < I64_MIN || v > U64 ? undefined : v >= 0n ? v : BigInt.asUintN(64, v);
  if (typeof v === 'number') return Number.isSafeInteger(v) ? BigInt.asUintN(64, BigInt(v)) : undefined;
  if (v instanceof Uint8Array) {
    if (v.length === 0) return undefined;
    let x = 0n;
    for (let i = Math.max(0, v.length - 8); i < v.length; i++) x = (x << 8n) | BigInt(v[i]);
    return x;
  }
  return undefined;
}

class Bad extends Error {}

function hashes(v: unknown, max: number): bigint[] {
  if (!Array.isArray(v)) throw new Bad('wrong_type');
  if (v.length > max) throw new Bad('too_large');
  return v.map((h) => {
    const x = hashValue(h);
    if (x === undefined) throw new Bad('wrong_type');
    return x;
  });
}

const optStr = (v: unknown): string | null => {
  if (v === undefined || v === null) return null;
  if (typeof v !== 'string') throw new Bad('wrong_type');
  return v;
};

function int(v: unknown, max: number): number {
  const n = typeof v === 'bigint' ? Number(v) : v;
  if (typeof n !== 'number' || !Number.isInteger(n) || n < 0) throw new Bad('wrong_type');
  if (n > max) throw new Bad('too_large');
  return n;
}

/** Field reader over a map event or a positional one (element 0 is the tag, later fields optional by length). */
function fields(e: unknown, names: readonly string[]): ((name: string) => unknown) | undefined {
  if (e instanceof Map) return (name) => e.get(name);
  if (Array.isArray(e)) return (name) => e[names.indexOf(name) + 1];
  return undefined;
}

const STORED = ['block_hashes', 'parent_block_hash', 'token_ids', 'block_size', 'lora_id', 'medium', 'lora_name'];
const REMOVED = ['block_hashes', 'medium'];

function event(e: unknown, l: Required<DecodeLimits>): KvEvent {
  const tag = e instanceof Map ? e.get('type') : Array.isArray(e) ? e[0] : undefined;
  if (tag === 'AllBlocksCleared') return { type: 'AllBlocksCleared' };
  if (tag === 'BlockRemoved') {
    const f = fields(e, REMOVED)!;
    return { type: 'BlockRemoved', blockHashes: hashes(f('block_hashes'), l.maxBlocks), medium: optStr(f('medium')) };
  }
  if (tag !== 'BlockStored') throw new Bad(typeof tag === 'string' ? 'unknown_type' : 'wrong_type');
  const f = fields(e, STORED)!;
  const blockHashes = hashes(f('block_hashes'), l.maxBlocks);
  const p = f('parent_block_hash');
  const parent = p === null || p === undefined ? null : hashValue(p);
  if (parent === undefined) throw new Bad('wrong_type');
  const rawTokens = f('token_ids') ?? [];
  const bs = f('block_size');
  const blockSize = bs === undefined || bs === null ? 0 : int(bs, l.maxBlockSize);
  if (!Array.isArray(rawTokens)) throw new Bad('wrong_type');
  if (rawTokens.length > 0) {
    // Tokens are optional (offload tiers), but when present they are exactly block_size per hash.
    if (blockSize === 0 || rawTokens.length !== blockSize * blockHashes.length) throw new Bad('wrong_length');
    for (const t of rawTokens) if (typeof t !== 'number' || !Number.isInteger(t) || t < 0) throw new Bad('wrong_type');
  }
  return {
    type: 'BlockStored',
    blockHashes,
    parent,
    tokenIds: rawTokens as number[],
    blockSize,
    medium: optStr(f('medium')),
    loraName: optStr(f('lora_name')),
  };
}

/** Decodes one msgpack EventBatch; throws BatchRefused when the batch itself is unreadable. */
export function decodeBatch(payload: Uint8Array, limits: DecodeLimits = {}): DecodedBatch {
  const l = { maxEvents: 100_000, maxBlocks: 65_536, maxBlockSize: 4096, ...limits };
  let raw: unknown;
  try {
    raw = unpackr.unpack(payload);
  } catch (e) {
    throw new BatchRefused(`not msgpack: ${(e as Error).message}`);
  }
  let ts: unknown;
  let events: unknown;
  let rank: unknown;
  if (Array.isArray(raw) && (raw.length === 2 || raw.length === 3)) [ts, events, rank] = raw;
  else if (raw instanceof Map) {
    ts = raw.get('ts');
    events = raw.get('events');
    rank = raw.get('data_parallel_rank');
  } else throw new BatchRefused('not an EventBatch (an array of 2 or 3, or a map)');
  if (!Array.isArray(events)) throw new BatchRefused('EventBatch events is not an array');
  if (events.length > l.maxEvents)
    throw new BatchRefused(`EventBatch has ${events.length} events (limit ${l.maxEvents})`);
  const out: DecodedBatch = {
    ts: typeof ts === 'number' ? ts : Number.NaN,
    dpRank: typeof rank === 'number' ? rank : null,
    events: [],
    dropped: {},
  };
  for (const e of events) {
    try {
      out.events.push(event(e, l));
    } catch (err) {
      const why = err instanceof Bad ? err.message : 'wrong_type';
      out.dropped[why] = (out.dropped[why] ?? 0) + 1;
    }
  }
  return out;
}
