// Tensor-parallel mapping between a decode (local) and a prefill (remote)
// engine, exactly as vLLM's NixlConnector / TpKVTopology does it:
//   tp_ratio = local_tp / remote_tp when local >= remote (must divide), else
//              -(remote_tp / local_tp);
//   remote ranks: [tp_rank // ratio] or [tp_rank * r + i for i < r];
//   replicated KV (MLA, or remote TP >= KV heads): whole blocks from one rank;
//   heterogeneous TP (ratio > 1): the rank's slice at (tp_rank % ratio) *
//   local_block_len of each remote block;
//   ratio < 0: local blocks split into r chunks, chunk i from remote rank
//   tp_rank * r + i.
import { NixlError } from '../errors';
import type { KvLayout } from './layout';
import type { NixlAgentMetadata } from '../handshake/codec';

export class KvLayoutError extends NixlError {
  constructor(message: string) {
    super(message, 'NIXL_ERR_MISMATCH');
    this.name = 'KvLayoutError';
  }
}

export function tpRatio(localTp: number, remoteTp: number): number {
  if (localTp >= remoteTp) {
    if (localTp % remoteTp !== 0)
      throw new KvLayoutError(`local TP ${localTp} is not a multiple of remote TP ${remoteTp}`);
    return localTp / remoteTp;
  }
  if (remoteTp % localTp !== 0)
    throw new KvLayoutError(`remote TP ${remoteTp} is not a multiple of local TP ${localTp}`);
  return -(remoteTp / localTp);
}

/** vLLM's is_kv_replicated: remote_tp // total_num_kv_heads >= 1. */
export function isKvReplicated(remoteTp: number, totalNumKvHeads: number): boolean {
  return Math.floor(remoteTp / totalNumKvHeads) >= 1;
}

export function replicatesKvCache(isMla: boolean, remoteTp: number, totalNumKvHeads: number): boolean {
  return isMla || isKvReplicated(remoteTp, totalNumKvHeads);
}

export function targetRemoteRanks(localTp: number, localRank: number, remoteTp: number): number[] {
  const r = tpRatio(localTp, remoteTp);
  if (r > 0) return [Math.floor(localRank / r)];
  return Array.from({ length: -r }, (_, i) => localRank * -r + i);
}

/** How many decode ranks read each prefill rank (the prefill side's count of notifications to wait for). */
export function consumersPerProducer(prefillTp: number, decodeTp: number): number {
  return decodeTp > prefillTp ? decodeTp / prefillTp : 1;
}

/** One read from one remote rank: which part of each local and remote block. */
export interface RankRead {
  remoteRank: number;
  /** Byte offset and length inside each local block, per region. */
  local: Array<{ offset: number; len: number }>;
  /** Byte offset inside each remote block, per region (length = local len). */
  remoteOffset: number[];
  /** MLA with remote TP > local TP: only notify this rank, read nothing. */
  notifyOnly: boolean;
}

export interface ReadPlan {
  tpRatio: number;
  replicated: boolean;
  reads: RankRead[];
}

/**
 * Checks a remote rank's layout against ours (vLLM's
 * _validate_remote_agent_handshake) and plans the reads. Throws KvLayoutError
 * with what does not match.
 */
export function planReads(local: KvLayout, remoteTp: number, remote: NixlAgentMetadata): ReadPlan {
  const ratio = tpRatio(local.tpSize, remoteTp);
  const isMla = local.isMla ?? false;
  const kvReplicated = isKvReplicated(remoteTp, local.totalNumKvHeads);
  const replicated = isMla || kvReplicated;
  const where = `remote engine '${remote.engineId}'`;
  if (ratio < 0 && kvReplicated && !isMla) {
    throw new KvLayoutError(
      `${where}: remote TP ${remoteTp} > local TP ${local.tpSize} with a replicated KV cache (TP >= ${local.totalNumKvHeads} KV heads) is not supported`,
    );
  }
  if (!isMla && remote.kvCacheLayout !== local.kvCacheLayout) {
    throw new KvLayoutError(
      `${where}: KV cache layout ${remote.kvCacheLayout} differs from local ${local.kvCacheLayout}; heterogeneous TP needs the same layout (HND)`,
    );
  }
  if (remote.blockSize !== local.blockSize) {
    throw new KvLayoutError(
      `${where}: block size ${remote.blockSize} tokens differs from local ${local.blockSize}; different block sizes are not supported`,
    );
  }
  if (remote.kvCachesBaseAddr.length !== local.baseAddrs.length) {
    throw new KvLayoutError(
      `${where}: ${remote.kvCachesBaseAddr.length} KV regions, local has ${local.baseAddrs.length} (different model or layer count?)`,
    );
  }
  if (remote.blockLens.length !== remote.kvCachesBaseAddr.length) {
    throw new KvLayoutError(
      `${where}: ${remote.blockLens.length} block lens for ${remote.kvCachesBaseAddr.length} regions`,
    );
  }
  if (!replicated && Math.abs(ratio) !== 1 && local.kvCacheLayout !== 'HND') {
    throw new KvLayoutError(
      `${where}: heterogeneous TP slices heads and needs the HND layout, not ${local.kvCacheLayout}`,
    );
  }
  if (replicated) {
    local.blockLens.forEach((l, i) => {
      if (remote.blockLens[i] !== l)
        throw new KvLayoutError(
          `${where}: region ${i} block len ${remote.blockLens[i]} != local ${l}; KV cache sizes must match when replicated`,
        );
    });
  } else {
    const rb = remote.blockLens[0];
    if (remote.blockLens.some((b) => b !== rb))
      throw new KvLayoutError(`${where}: all remote regions must have the same block len`);
    const lb = local.blockLens[0];
    if (local.blockLens.some((b) => b !== lb))
      throw new KvLayoutError('local regions must all have the same block len');
    if (ratio > 0 && rb !== lb * ratio) {
      throw new KvLayoutError(
        `${where}: remote block len ${rb} != local ${lb} x tp_ratio ${ratio} (remote cache must be [2, N, local_kv_heads*${ratio}, page, head_dim], same dtype)`,
      );
    }
    if (ratio < 0 && rb * -ratio !== lb) {
      throw new KvLayoutError(
        `${where}: remote block len ${rb} != local ${lb} / ${-ratio} (remote cache must be [2, N, local_kv_heads/${-ratio}, page, head_dim], same dtype)`,
      );
    }
  }

  const ranks = targetRemoteRanks(local.tpSize, local.tpRank, remoteTp);
  const indexesIntoRemote = !replicated && ratio > 0;
  const reads: RankRead[] = ranks.map((remoteRank, i) => {
    if (ratio < 0 && !isMla) {
      // Our block is |r| remote blocks side by side: chunk i from remote rank i.
      const chunk = local.blockLens.map((l) => l / -ratio);
      return {
        remoteRank,
        local: chunk.map((len) => ({ offset: i * len, len })),
        remoteOffset: chunk.map(() => 0),
        notifyOnly: false,
      };
    }
    const rankOffset = indexesIntoRemote ? local.tpRank % ratio : 0;
    return {
      remoteRank,
      local: local.blockLens.map((len) => ({ offset: 0, len })),
      remoteOffset: local.blockLens.map((len) => rankOffset * len),
      // MLA, remote TP > local TP: the cache is the same on every remote rank,
      // read it once and only notify the others.
      notifyOnly: isMla && ratio < 0 && i > 0,
    };
  });
  return { tpRatio: ratio, replicated, reads };
}
