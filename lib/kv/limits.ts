// Limits on everything a peer or a request sizes. A prefill's metadata and a
// request's kv_transfer_params name counts (TP and PP sizes, block ratios,
// block ids) that the decode turns into arrays, sockets and descriptors: each
// is checked against a bound derived from the local layout *before* anything
// is allocated or opened, and a violation fails that one pull with an error
// naming the field and both values, so that no peer or client can take the
// decode process down (a 2^30 block ratio once expanded past V8's array limit;
// tp_size 4096 opened 4096 sockets at once).
import { NixlError } from '../errors';
import type { NixlAgentMetadata } from '../handshake/model';
import { showValue } from '../show-value';
import type { KvLayout } from './layout';

/** Bounds on what a peer or a request may size, checked before anything is allocated or opened. */
export interface PullLimits {
  /** Largest remote tp_size accepted. Default 1024. */
  maxTpSize?: number;
  /** Largest remote pp_size accepted (also at most one per local region). Default 64. */
  maxPpSize?: number;
  /** Remote (pp, tp) ranks one pull may handshake with. Default 64. */
  maxRemoteRanks?: number;
  /** Handshakes of one connect in flight at once (the rest queue). Default 8. */
  handshakeConcurrency?: number;
  /** Descriptors one remote rank's prepped list may hold (regions x blocks). Default 2^25. */
  maxRemoteDescriptors?: number;
}

/** The bounds used when none are given. */
export const DEFAULT_LIMITS: Required<PullLimits> = {
  maxTpSize: 1024,
  maxPpSize: 64,
  maxRemoteRanks: 64,
  handshakeConcurrency: 8,
  maxRemoteDescriptors: 2 ** 25,
};

function outOfBounds(field: string, value: unknown, bound: string): NixlError {
  return new NixlError(`${field}: ${showValue(value)} is out of bounds (${bound})`, 'NIXL_ERR_INVALID_PARAM');
}

function isCount(v: unknown, max: number): v is number {
  return typeof v === 'number' && Number.isInteger(v) && v >= 1 && v <= max;
}

/**
 * The TP / PP sizes a request names, before any handshake: positive integers
 * within the limits, at most one pipeline rank per local region, and at most
 * maxRemoteRanks ranks to ask in all.
 */
export function checkRemoteSizes(
  layout: KvLayout,
  remote: { tpSize: unknown; ppSize?: unknown; dcpSize?: unknown },
  limits: Required<PullLimits>,
): void {
  if (!isCount(remote.tpSize, limits.maxTpSize))
    throw outOfBounds('tp_size', remote.tpSize, `an integer from 1 to ${limits.maxTpSize}`);
  const maxPp = Math.min(limits.maxPpSize, layout.baseAddrs.length);
  const pp = remote.ppSize ?? 1;
  if (!isCount(pp, maxPp))
    throw outOfBounds(
      'pp_size',
      pp,
      `an integer from 1 to ${maxPp}: each pipeline rank holds at least one of the ${layout.baseAddrs.length} local regions`,
    );
  const dcp = remote.dcpSize ?? 1;
  if (!isCount(dcp, limits.maxTpSize)) throw outOfBounds('dcp_size', dcp, `an integer from 1 to ${limits.maxTpSize}`);
  const perPp = remote.tpSize > layout.tpSize ? remote.tpSize / layout.tpSize : 1;
  if (pp * perPp > limits.maxRemoteRanks)
    throw outOfBounds(
      'tp_size x pp_size',
      `${remote.tpSize} x ${pp}`,
      `local tp_size ${layout.tpSize} would read ${pp * perPp} remote ranks; at most ${limits.maxRemoteRanks}`,
    );
}

/**
 * What a remote rank's metadata sizes on our side: its block counts (the
 * prepped descriptor list is regions x blocks) and its block ratio (logical
 * block ids are expanded by it), bounded by the rank's own block count.
 */
export function checkRemoteCounts(meta: NixlAgentMetadata, limits: Required<PullLimits>): void {
  const where = `remote engine '${String(meta.engineId).slice(0, 80)}'`;
  const counts = meta.regionNumBlocks ?? meta.kvCachesBaseAddr.map(() => meta.numBlocks);
  let total = 0;
  let least = Number.POSITIVE_INFINITY;
  for (const c of counts) {
    if (!isCount(c, limits.maxRemoteDescriptors))
      throw outOfBounds(`${where}: num_blocks`, c, `an integer from 1 to ${limits.maxRemoteDescriptors}`);
    total += c;
    least = Math.min(least, c);
  }
  if (!isCount(meta.numBlocks, limits.maxRemoteDescriptors))
    throw outOfBounds(`${where}: num_blocks`, meta.numBlocks, `an integer from 1 to ${limits.maxRemoteDescriptors}`);
  if (total > limits.maxRemoteDescriptors)
    throw outOfBounds(
      `${where}: regions x num_blocks`,
      total,
      `at most ${limits.maxRemoteDescriptors} descriptors per remote rank`,
    );
  const r = meta.physicalBlocksPerLogical;
  if (!isCount(r, least))
    throw outOfBounds(
      `${where}: physical_blocks_per_logical_kv_block`,
      r,
      `an integer from 1 to the rank's ${least} blocks per region`,
    );
}

/**
 * The last (head: the first) `count` kernel block ids of logical ids expanded by ratio r
 * (vLLM's _logical_to_kernel_block_ids: logical b covers b*r .. b*r + r-1),
 * without building the whole expansion: every logical id must be an integer
 * whose kernel blocks lie below `limit`.
 */
export function expandTail(
  logical: ArrayLike<number>,
  r: number,
  count: number,
  limit: number,
  field = 'remote block ids',
  head = false,
): number[] {
  const n = logical.length;
  for (let i = 0; i < n; i++) {
    const b = logical[i];
    if (!Number.isInteger(b) || b < 0 || b * r + r > limit)
      throw new NixlError(
        `${field}: logical block ${showValue(b)} (x ${r} kernel blocks) is outside 0..${limit - 1}`,
        'NIXL_ERR_INVALID_PARAM',
      );
  }
  if (n * r < count)
    throw new NixlError(
      `${count} local blocks but only ${n * r} remote blocks (${n} logical x ${r})`,
      'NIXL_ERR_INVALID_PARAM',
    );
  const out = new Array<number>(count);
  // The last ones (vLLM: the uncached suffix of a partial prefix hit), or the first (a conversation's held prefix).
  const first = head ? 0 : n * r - count;
  for (let k = 0; k < count; k++) {
    const j = first + k;
    out[k] = logical[Math.floor(j / r)] * r + (j % r);
  }
  return out;
}
