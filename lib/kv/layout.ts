// How one engine rank's KV cache sits in memory: regions (one per layer, or
// one per layer per K/V), each numBlocks blocks of blockLens[i] bytes, block
// b at baseAddrs[i] + b * blockStrides[i].
import { invalidParam } from '../errors';
import {
  type AgentMetadataInput,
  KV_LAYOUTS,
  type KvLayoutName,
  type NixlAgentMetadata,
  layoutName,
} from '../handshake/model';
import type { MemType } from '../descriptors';

/** How an engine's KV cache lies in memory: its TP rank, block geometry and one region per layer (and K/V). */
export interface KvLayout {
  engineId: string;
  tpSize: number;
  tpRank: number;
  dpRank?: number;
  /** Pipeline-parallel rank and size of this engine rank. Default 0 of 1. */
  ppRank?: number;
  ppSize?: number;
  /** Kernel blocks per region. */
  numBlocks: number;
  /** Tokens per kernel block. */
  blockSize: number;
  /** Bytes per block, per region. */
  blockLens: number[];
  /** Bytes from one block to the next, per region. Default: blockLens (blocks back to back). */
  blockStrides?: number[];
  /** Base address of each region. */
  baseAddrs: bigint[];
  deviceId?: number;
  memType?: MemType;
  /** vLLM's layout name (LBHNC, LBNHC, BLHNC, BLNHC), or v0.13's HND / NHD. */
  kvCacheLayout: KvLayoutName | 'HND' | 'NHD';
  /** Kernel blocks per logical (scheduler) block; logical ids in kv_transfer_params expand by it. Default 1. */
  physicalBlocksPerLogical?: number;
  /** Layer name of each region; when both sides send names they must match exactly (vLLM). */
  regionNames?: string[];
  /** v12 metadata field. Default 'FLASH_ATTN'. */
  attnBackendName?: string;
  /** MLA: one latent cache per layer, replicated on every TP rank. */
  isMla?: boolean;
  /** Total KV heads of the model (TP >= this replicates the cache). */
  totalNumKvHeads: number;
}

const isPosInt = (v: unknown) => Number.isSafeInteger(v) && (v as number) >= 1;

/** Throws NIXL_ERR_INVALID_PARAM naming what is wrong with a layout. */
export function checkLayout(l: KvLayout): void {
  const bad = (m: string): never => {
    throw invalidParam(`KV layout of engine '${l.engineId}': ${m}`);
  };
  if (!l.engineId) bad('engineId is empty');
  if (!isPosInt(l.tpSize)) bad('tpSize must be a positive integer');
  if (!Number.isInteger(l.tpRank) || l.tpRank < 0 || l.tpRank >= l.tpSize)
    bad(`tpRank ${l.tpRank} is not in 0..${l.tpSize - 1}`);
  const ppSize = l.ppSize ?? 1;
  if (!isPosInt(ppSize)) bad('ppSize must be a positive integer');
  if (!Number.isInteger(l.ppRank ?? 0) || (l.ppRank ?? 0) < 0 || (l.ppRank ?? 0) >= ppSize)
    bad(`ppRank ${l.ppRank} is not in 0..${ppSize - 1}`);
  if (!isPosInt(l.numBlocks)) bad('numBlocks must be a positive integer');
  if (!isPosInt(l.blockSize)) bad('blockSize must be a positive integer');
  if (!isPosInt(l.physicalBlocksPerLogical ?? 1)) bad('physicalBlocksPerLogical must be a positive integer');
  if (l.baseAddrs.length === 0) bad('no regions');
  if (l.blockLens.length !== l.baseAddrs.length)
    bad(`${l.blockLens.length} block lens for ${l.baseAddrs.length} regions`);
  if (l.blockLens.some((b) => !isPosInt(b))) bad('block lens must be positive integers');
  const strides = l.blockStrides ?? l.blockLens;
  if (strides.length !== l.baseAddrs.length) bad(`${strides.length} block strides for ${l.baseAddrs.length} regions`);
  strides.forEach((s, i) => {
    if (!isPosInt(s) || s < l.blockLens[i])
      bad(`block stride ${s} of region ${i} is below its block len ${l.blockLens[i]}`);
  });
  if (l.regionNames && l.regionNames.length !== l.baseAddrs.length)
    bad(`${l.regionNames.length} region names for ${l.baseAddrs.length} regions`);
  if (!isPosInt(l.totalNumKvHeads)) bad('totalNumKvHeads must be a positive integer');
  const name = layoutName(l.kvCacheLayout);
  if (!name)
    bad(`kvCacheLayout '${String(l.kvCacheLayout)}' is not one of ${Object.keys(KV_LAYOUTS).join(', ')}, HND, NHD`);
  if (!KV_LAYOUTS[name as KvLayoutName].blockContiguous)
    bad(`kvCacheLayout ${name} does not keep a block of a layer in one byte range; nixl-node reads whole blocks`);
}

/** The layout's name in the model vocabulary (HND -> LBHNC). */
export function layoutOf(l: KvLayout): KvLayoutName {
  return layoutName(l.kvCacheLayout) as KvLayoutName;
}

/** The NixlAgentMetadata a prefill rank advertises for this layout. */
export function toAgentMetadata(l: KvLayout, agentMetadata: Buffer): AgentMetadataInput {
  checkLayout(l);
  const regions = l.baseAddrs.length;
  return {
    engineId: l.engineId,
    agentMetadata,
    kvCachesBaseAddr: l.baseAddrs,
    deviceId: l.deviceId ?? 0,
    numBlocks: l.numBlocks,
    blockLens: l.blockLens,
    blockStrides: l.blockStrides ?? l.blockLens,
    kvCacheLayout: layoutOf(l),
    blockSize: l.blockSize,
    ssmSizes: [0, 0],
    attnBackendName: l.attnBackendName ?? 'FLASH_ATTN',
    physicalBlocksPerLogical: l.physicalBlocksPerLogical ?? 1,
    regionNumBlocks: Array(regions).fill(l.numBlocks),
    regionGroupIds: null,
    regionNames: l.regionNames ?? null,
    regionMemTypes: Array(regions).fill(l.memType ?? 'DRAM'),
    dcpSize: 1,
    pcpSize: 1,
    regionMembers: [],
  };
}

/** The remote rank as a decode worker learns it from the handshake. */
export interface RemoteRankInfo {
  tpRank: number;
  tpSize: number;
  meta: NixlAgentMetadata;
}
