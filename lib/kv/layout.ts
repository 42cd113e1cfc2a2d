// How one engine rank's KV cache sits in memory: regions (one per layer per
// K/V, or one per layer for MLA), each num_blocks blocks of block_lens[i]
// bytes, laid out back to back from the region's base address.
import { invalidParam } from '../errors';
import type { KvCacheLayout, NixlAgentMetadata } from '../handshake/codec';
import type { MemType } from '../descriptors';

export interface KvLayout {
  engineId: string;
  tpSize: number;
  tpRank: number;
  dpRank?: number;
  numBlocks: number;
  /** Tokens per block. */
  blockSize: number;
  /** Bytes per block, per region. */
  blockLens: number[];
  /** Base address of each region. */
  baseAddrs: bigint[];
  deviceId?: number;
  memType?: MemType;
  kvCacheLayout: KvCacheLayout;
  /** MLA: one latent cache per layer, replicated on every TP rank. */
  isMla?: boolean;
  /** Total KV heads of the model (TP >= this replicates the cache). */
  totalNumKvHeads: number;
}

export function checkLayout(l: KvLayout): void {
  const bad = (m: string): never => {
    throw invalidParam(`KV layout of engine '${l.engineId}': ${m}`);
  };
  if (!l.engineId) bad('engineId is empty');
  if (!Number.isInteger(l.tpSize) || l.tpSize < 1) bad('tpSize must be a positive integer');
  if (!Number.isInteger(l.tpRank) || l.tpRank < 0 || l.tpRank >= l.tpSize)
    bad(`tpRank ${l.tpRank} is not in 0..${l.tpSize - 1}`);
  if (!Number.isInteger(l.numBlocks) || l.numBlocks < 1) bad('numBlocks must be a positive integer');
  if (!Number.isInteger(l.blockSize) || l.blockSize < 1) bad('blockSize must be a positive integer');
  if (l.baseAddrs.length === 0) bad('no regions');
  if (l.blockLens.length !== l.baseAddrs.length)
    bad(`${l.blockLens.length} block lens for ${l.baseAddrs.length} regions`);
  if (l.blockLens.some((b) => !Number.isInteger(b) || b < 1)) bad('block lens must be positive integers');
  if (!Number.isInteger(l.totalNumKvHeads) || l.totalNumKvHeads < 1) bad('totalNumKvHeads must be a positive integer');
  if (l.kvCacheLayout !== 'HND' && l.kvCacheLayout !== 'NHD') bad("kvCacheLayout must be 'HND' or 'NHD'");
}

/** The NixlAgentMetadata a prefill rank advertises for this layout. */
export function toAgentMetadata(l: KvLayout, agentMetadata: Buffer): NixlAgentMetadata {
  checkLayout(l);
  return {
    engineId: l.engineId,
    agentMetadata,
    kvCachesBaseAddr: l.baseAddrs,
    deviceId: l.deviceId ?? 0,
    numBlocks: l.numBlocks,
    blockLens: l.blockLens,
    kvCacheLayout: l.kvCacheLayout,
    blockSize: l.blockSize,
  };
}

/** The remote rank as a decode worker learns it from the handshake. */
export interface RemoteRankInfo {
  tpRank: number;
  tpSize: number;
  meta: NixlAgentMetadata;
}
