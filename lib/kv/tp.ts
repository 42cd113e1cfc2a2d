// Tensor-parallel mapping between a decode (local) and a prefill (remote)
// engine, and the checks vLLM runs on a remote rank's metadata before any
// READ (its _validate_remote_agent_handshake; spec section 4), in one file:
//   tp_ratio = local_tp / remote_tp when local >= remote (must divide), else
//              -(remote_tp / local_tp);
//   remote ranks: [tp_rank // ratio] or [tp_rank * r + i for i < r];
//   replicated KV (MLA, or remote TP >= KV heads): whole blocks from one rank;
//   heterogeneous TP (ratio > 1): the rank's slice at (tp_rank % ratio) *
//   local_block_len of each remote block;
//   ratio < 0: local blocks split into r chunks, chunk i from remote rank
//   tp_rank * r + i;
//   pipeline parallel: remote pp rank p holds the next n_p of our regions.
// Errors name the field and both values.
import { NixlError } from '../errors';
import { KV_LAYOUTS, type NixlAgentMetadata, type WireProfile } from '../handshake/model';
import { showValue } from '../show-value';
import { type KvLayout, layoutOf } from './layout';

/** Layouts that cannot be mapped onto each other (NIXL_ERR_MISMATCH). */
export class KvLayoutError extends NixlError {
  constructor(message: string) {
    super(message, 'NIXL_ERR_MISMATCH');
    this.name = 'KvLayoutError';
  }
}

/** local / remote TP size when local is larger, minus remote / local when smaller (vLLM's tp_ratio). */
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

/** Whether every remote rank holds all KV heads (MLA, or fewer KV heads than ranks). */
export function replicatesKvCache(isMla: boolean, remoteTp: number, totalNumKvHeads: number): boolean {
  return isMla || isKvReplicated(remoteTp, totalNumKvHeads);
}

/** The remote TP ranks a local rank reads from (vLLM's rule). */
export function targetRemoteRanks(localTp: number, localRank: number, remoteTp: number): number[] {
  const r = tpRatio(localTp, remoteTp);
  if (r > 0) return [Math.floor(localRank / r)];
  return Array.from({ length: -r }, (_, i) => localRank * -r + i);
}

/** How many decode ranks read each prefill rank (v0.13: what the prefill derives from the decode TP size). */
export function consumersPerProducer(prefillTp: number, decodeTp: number): number {
  return decodeTp > prefillTp ? decodeTp / prefillTp : 1;
}

/**
 * vLLM v12's dcp_consumer_count: how many completion notifications one
 * prefill rank waits for, sent as the number after ':' (the decode side
 * computes it; the prefill side trusts it).
 */
export function expectedConsumers(localTp: number, remoteTp: number, localDcp = 1, remoteDcp = 1): number {
  if (remoteDcp > 1) return localDcp === 1 ? localTp : Math.max(1, Math.floor(localDcp / remoteDcp));
  return Math.max(1, tpRatio(localTp, remoteTp));
}

/** The completion notification a decode rank sends each prefill rank it read, in the profile's format. */
export function completionNotif(wire: WireProfile, requestId: string, localTp: number, remoteTp: number): string {
  const n = wire.notifSuffix === 'decode-tp-size' ? localTp : expectedConsumers(localTp, remoteTp);
  return `${requestId}:${n}`;
}

/** How many notifications a prefill rank waits for, given a notification's suffix. */
export function notifsToWaitFor(wire: WireProfile, suffix: number, prefillTp: number): number {
  return wire.notifSuffix === 'decode-tp-size' ? consumersPerProducer(prefillTp, suffix) : Math.max(1, suffix);
}

/** The (pp_rank, tp_rank) pairs a decode rank asks for, and only those (vLLM's listener dies on others). */
export function handshakeTargets(
  localTp: number,
  localRank: number,
  remote: { tpSize: number; ppSize?: number; dcpSize?: number },
): Array<{ ppRank: number; tpRank: number }> {
  if ((remote.dcpSize ?? 1) > 1)
    throw new NixlError(
      `reading from a decode-context-parallel prefill (dcp_size ${remote.dcpSize}) is not supported by nixl-node`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  const tps = targetRemoteRanks(localTp, localRank, remote.tpSize);
  const out: Array<{ ppRank: number; tpRank: number }> = [];
  for (let pp = 0; pp < (remote.ppSize ?? 1); pp++) for (const tp of tps) out.push({ ppRank: pp, tpRank: tp });
  return out;
}

/** One read from one remote rank: which part of each local and remote block. */
export interface RankRead {
  remoteRank: number;
  /** The remote rank's pipeline rank, and the first of our regions its region 0 maps to. */
  ppRank: number;
  regionStart: number;
  /** Byte offset and length inside each local block, per region. */
  local: Array<{ offset: number; len: number }>;
  /** Byte offset inside each remote block, per region (length = local len). */
  remoteOffset: number[];
  /** MLA with remote TP > local TP: only notify this rank, read nothing. */
  notifyOnly: boolean;
}

/** How a local rank reads one remote rank: the ratio, replication, and the byte ranges. */
export interface ReadPlan {
  tpRatio: number;
  replicated: boolean;
  reads: RankRead[];
}

/** Where a remote rank's regions land among ours. */
export interface PlanContext {
  /** The remote rank's pipeline rank, and the first of our regions its regions map to. Default 0, 0. */
  ppRank?: number;
  regionStart?: number;
  /** dcp_size the kv_transfer_params announced. Default 1. */
  dcpSize?: number;
}

/**
 * Checks a remote rank's metadata against our layout as vLLM does and plans
 * the reads. Throws KvLayoutError (NIXL_ERR_MISMATCH) naming the field and
 * both values, or NixlError NIXL_ERR_NOT_SUPPORTED for what vLLM accepts but
 * nixl-node cannot read.
 */
export function planReads(
  local: KvLayout,
  remoteTp: number,
  remote: NixlAgentMetadata,
  ctx: PlanContext = {},
): ReadPlan {
  const c = checker(remote);
  const ratio = tpRatio(local.tpSize, remoteTp);
  const isMla = local.isMla ?? false;
  const kvReplicated = isKvReplicated(remoteTp, local.totalNumKvHeads);
  const replicated = isMla || kvReplicated;
  checkSupported(c, remote, ctx);
  checkTpAndLayout(c, local, remote, remoteTp, { ratio, isMla, kvReplicated, replicated });
  const localLens = checkRegions(c, local, remote, ctx);
  checkBlockLens(c, localLens, remote, ratio, replicated);
  const reads = rankReads(local, remoteTp, localLens, {
    ratio,
    isMla,
    replicated,
    ppRank: ctx.ppRank ?? 0,
    regionStart: ctx.regionStart ?? 0,
  });
  return { tpRatio: ratio, replicated, reads };
}

/** How planReads refuses: a mismatch names the field and both values; unsupported what nixl-node cannot read. */
interface Checker {
  where: string;
  mismatch(field: string, r: unknown, l: unknown, why?: string): never;
  unsupported(m: string): never;
}

function checker(remote: NixlAgentMetadata): Checker {
  const where = `remote engine '${remote.engineId}'`;
  return {
    where,
    mismatch: (field, r, l, why = '') => {
      throw new KvLayoutError(`${where}: ${field}: remote ${fmt(r)}, local ${fmt(l)}${why ? ` (${why})` : ''}`);
    },
    unsupported: (m) => {
      throw new NixlError(`${where}: ${m} is not supported by nixl-node`, 'NIXL_ERR_NOT_SUPPORTED');
    },
  };
}

/** What vLLM reshapes or refuses before validating. */
function checkSupported(c: Checker, remote: NixlAgentMetadata, ctx: PlanContext): void {
  const memTypes = new Set(remote.regionMemTypes ?? []);
  if (memTypes.size > 1) c.unsupported(`a mixed-memory producer (region_mem_types ${[...memTypes].join(', ')})`);
  if (remote.ssmSizes[0] !== 0 || remote.ssmSizes[1] !== 0)
    c.unsupported(`Mamba state (ssm_sizes [${remote.ssmSizes.join(', ')}])`);
  if (remote.pcpSize !== 1) c.unsupported(`prefill context parallelism (pcp_size ${remote.pcpSize})`);
  if (remote.dcpSize !== (ctx.dcpSize ?? 1))
    c.mismatch('dcp_size', remote.dcpSize, ctx.dcpSize ?? 1, 'kv_transfer_params dcp_size');
  if (remote.dcpSize !== 1) c.unsupported(`decode context parallelism (dcp_size ${remote.dcpSize})`);
}

/** TP and replication, block sizes, and the layout. */
function checkTpAndLayout(
  c: Checker,
  local: KvLayout,
  remote: NixlAgentMetadata,
  remoteTp: number,
  t: { ratio: number; isMla: boolean; kvReplicated: boolean; replicated: boolean },
): void {
  if (t.ratio < 0 && t.kvReplicated && !t.isMla)
    c.mismatch(
      'tp_size',
      remoteTp,
      local.tpSize,
      `a replicated KV cache (TP >= ${local.totalNumKvHeads} KV heads) cannot be split over more prefill ranks`,
    );
  // Block sizes: P's block must divide D's; nixl-node reads only equal ones.
  if (local.blockSize % remote.blockSize !== 0)
    c.mismatch('block_size', remote.blockSize, local.blockSize, "the prefill block size must divide the decode's");
  if (remote.blockSize !== local.blockSize)
    c.unsupported(`a block size ratio of ${local.blockSize / remote.blockSize}`);
  // Layout (not for MLA): equal, and heads-major for heterogeneous TP.
  const localLayout = layoutOf(local);
  if (!t.isMla && remote.kvCacheLayout !== localLayout)
    c.mismatch('kv_cache_layout', remote.kvCacheLayout, localLayout);
  if (!t.replicated && Math.abs(t.ratio) !== 1 && !KV_LAYOUTS[localLayout].headsMajor)
    c.mismatch(
      'kv_cache_layout',
      remote.kvCacheLayout,
      localLayout,
      'heterogeneous TP slices heads and needs a heads-major layout such as LBHNC',
    );
}

/** Region counts, per-region lists, strides, block counts and names; our block lens of its regions. */
function checkRegions(c: Checker, local: KvLayout, remote: NixlAgentMetadata, ctx: PlanContext): number[] {
  const regionStart = ctx.regionStart ?? 0;
  const n = remote.kvCachesBaseAddr.length;
  if (regionStart + n > local.baseAddrs.length)
    c.mismatch(
      'kv_caches_base_addr (regions)',
      n,
      local.baseAddrs.length - regionStart,
      'different model or layer count?',
    );
  if (ctx.regionStart === undefined && n !== local.baseAddrs.length)
    c.mismatch('kv_caches_base_addr (regions)', n, local.baseAddrs.length, 'different model or layer count?');
  for (const [field, list] of [
    ['block_lens', remote.blockLens],
    ['block_strides', remote.blockStrides],
    ['region_num_blocks', remote.regionNumBlocks],
    ['region_group_ids', remote.regionGroupIds],
    ['region_mem_types', remote.regionMemTypes],
    ['region_names', remote.regionNames],
  ] as const) {
    if (list !== null && list.length !== n) c.mismatch(`${field} (entries)`, list.length, n, 'one per region');
  }
  const localLens = local.blockLens.slice(regionStart, regionStart + n);
  remote.blockStrides.forEach((s, i) => {
    if (s < remote.blockLens[i])
      throw new KvLayoutError(`${c.where}: block_strides[${i}] ${s} is below block_lens[${i}] ${remote.blockLens[i]}`);
  });
  if (remote.numBlocks < 1) throw new KvLayoutError(`${c.where}: num_blocks ${remote.numBlocks} is not positive`);
  (remote.regionNumBlocks ?? []).forEach((count, i) => {
    if (count < 1) throw new KvLayoutError(`${c.where}: region_num_blocks[${i}] ${count} is not positive`);
  });
  if (remote.regionNames !== null && local.regionNames !== undefined) {
    const mine = local.regionNames.slice(regionStart, regionStart + n);
    remote.regionNames.forEach((name, i) => {
      if (name !== mine[i]) c.mismatch(`region_names[${i}]`, name, mine[i], 'layer names must match in order');
    });
  }
  return localLens;
}

/** Per-region block lens (vLLM's rules). */
function checkBlockLens(
  c: Checker,
  localLens: number[],
  remote: NixlAgentMetadata,
  ratio: number,
  replicated: boolean,
): void {
  localLens.forEach((l, i) => {
    const r = remote.blockLens[i];
    const field = `block_lens[${i}]`;
    if (replicated) {
      if (r !== l) c.mismatch(field, r, l, 'a replicated cache is read whole');
    } else if (ratio > 0) {
      if (r !== l * ratio)
        c.mismatch(field, r, l, `remote = local x tp_ratio ${ratio}: same heads per rank x ratio, same dtype`);
    } else if (r * -ratio !== l) {
      c.mismatch(field, r, l, `remote = local / ${-ratio}`);
    }
  });
}

/** The read of each remote rank this rank reads from. */
function rankReads(
  local: KvLayout,
  remoteTp: number,
  localLens: number[],
  p: { ratio: number; isMla: boolean; replicated: boolean; ppRank: number; regionStart: number },
): RankRead[] {
  const { ratio, isMla, ppRank, regionStart } = p;
  const ranks = targetRemoteRanks(local.tpSize, local.tpRank, remoteTp);
  const indexesIntoRemote = !p.replicated && ratio > 0;
  return ranks.map((remoteRank, i) => {
    if (ratio < 0 && !isMla) {
      // Our block is |r| remote blocks side by side: chunk i from remote rank i.
      const chunk = localLens.map((l) => l / -ratio);
      return {
        remoteRank,
        ppRank,
        regionStart,
        local: chunk.map((len) => ({ offset: i * len, len })),
        remoteOffset: chunk.map(() => 0),
        notifyOnly: false,
      };
    }
    const rankOffset = indexesIntoRemote ? local.tpRank % ratio : 0;
    return {
      remoteRank,
      ppRank,
      regionStart,
      local: localLens.map((len) => ({ offset: 0, len })),
      remoteOffset: localLens.map((len) => rankOffset * len),
      // MLA, remote TP > local TP: the cache is the same on every remote rank,
      // read it once and only notify the others.
      notifyOnly: isMla && ratio < 0 && i > 0,
    };
  });
}

function fmt(v: unknown): string {
  return typeof v === 'string' ? v : showValue(v);
}
