// vLLM's KV events as msgpack (vllm/distributed/kv_events.py): a batch is
// the array [ts, events, data_parallel_rank]; an event is a map with "type"
// (vLLM >= #42892) or, as an option for old consumers, a positional array
// led by its tag. Hashes and token ids are ints: 64-bit hashes go as uint64,
// never float64 (the handshake's writer; msgpackr would pick float64 for a
// bigint-less number past 2^53).
import { Float64, type MpValue, packMsgpack } from '../../../handshake/msgpack';

/** One event, as the tracker makes it. */
export type KvEvent =
  | {
      type: 'BlockStored';
      blockHashes: bigint[];
      parentBlockHash: bigint | null;
      tokenIds: number[];
      blockSize: number;
      medium?: string | null;
    }
  | { type: 'BlockRemoved'; blockHashes: bigint[]; medium?: string | null }
  | { type: 'AllBlocksCleared' };

function mapEvent(e: KvEvent): MpValue {
  if (e.type === 'AllBlocksCleared') return new Map([['type', e.type]]);
  if (e.type === 'BlockRemoved')
    return new Map<string, MpValue>([
      ['type', e.type],
      ['block_hashes', e.blockHashes],
      ['medium', e.medium ?? 'GPU'],
    ]);
  // Fields with no default are always present (lora_id, medium, lora_name); those with one, only when set.
  return new Map<string, MpValue>([
    ['type', e.type],
    ['block_hashes', e.blockHashes],
    ['parent_block_hash', e.parentBlockHash],
    ['token_ids', e.tokenIds],
    ['block_size', e.blockSize],
    ['lora_id', null],
    ['medium', e.medium ?? 'GPU'],
    ['lora_name', null],
  ]);
}

/** Positional, as vLLM 0.12..0.23 (8 elements for BlockStored: trailing defaults dropped). */
function arrayEvent(e: KvEvent): MpValue {
  if (e.type === 'AllBlocksCleared') return [e.type];
  if (e.type === 'BlockRemoved') return [e.type, e.blockHashes, e.medium ?? 'GPU'];
  return [e.type, e.blockHashes, e.parentBlockHash, e.tokenIds, e.blockSize, null, e.medium ?? 'GPU', null];
}

/** The msgpack of one EventBatch. `ts`: seconds (time.time()). */
export function encodeBatch(
  events: readonly KvEvent[],
  o: { ts: number; encoding?: 'map' | 'array'; dpRank?: number | null },
): Buffer {
  const enc = o.encoding === 'array' ? arrayEvent : mapEvent;
  return packMsgpack([new Float64(o.ts), events.map(enc), o.dpRank === undefined ? 0 : o.dpRank]);
}
