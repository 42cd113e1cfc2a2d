// KV block descriptors: prepped lists are region-major (descriptor id =
// blocks of the regions before + block, as vLLM), built once per remote engine and
// rank; per-request index lists are Uint32Arrays. Coalescing turns runs of
// adjacent blocks into single larger descriptors where both sides are
// contiguous in memory.

/** Where to read inside each block of each region. */
export interface BlockSlices {
  baseAddrs: readonly bigint[];
  /** Block stride per region (bytes between block b and b+1). */
  strides: readonly number[];
  offsets: readonly number[];
  lens: readonly number[];
  devId: number;
}

/** Blocks per region: one count for all, or one per region. */
export function regionCounts(regions: number, numBlocks: number | readonly number[]): readonly number[] {
  return typeof numBlocks === 'number' ? Array(regions).fill(numBlocks) : numBlocks;
}

/** [addr, len, devId] triples for every block of every region, region-major. */
export function allBlockDescs(s: BlockSlices, numBlocks: number | readonly number[]): BigUint64Array {
  const regions = s.baseAddrs.length;
  const counts = regionCounts(regions, numBlocks);
  const out = new BigUint64Array(counts.reduce((a, b) => a + b, 0) * 3);
  const dev = BigInt(s.devId);
  let k = 0;
  for (let r = 0; r < regions; r++) {
    const base = s.baseAddrs[r] + BigInt(s.offsets[r]);
    const stride = BigInt(s.strides[r]);
    const len = BigInt(s.lens[r]);
    for (let b = 0; b < counts[r]; b++) {
      out[k++] = base + BigInt(b) * stride;
      out[k++] = len;
      out[k++] = dev;
    }
  }
  return out;
}

/** Region-major descriptor ids of the given blocks (counts: blocks per region of the prepped list). */
export function blockDescIds(counts: readonly number[], blockIds: ArrayLike<number>): Uint32Array {
  const n = blockIds.length;
  const out = new Uint32Array(counts.length * n);
  let base = 0;
  for (let r = 0; r < counts.length; r++) {
    for (let i = 0; i < n; i++) out[r * n + i] = base + blockIds[i];
    base += counts[r];
  }
  return out;
}

/** Runs [start, end) over positions where both id lists step by +1. */
export function adjacentRuns(local: ArrayLike<number>, remote: ArrayLike<number>): Array<[number, number]> {
  const runs: Array<[number, number]> = [];
  let start = 0;
  for (let i = 1; i <= local.length; i++) {
    if (i === local.length || local[i] !== local[i - 1] + 1 || remote[i] !== remote[i - 1] + 1) {
      runs.push([start, i]);
      start = i;
    }
  }
  return runs;
}

/** Local and remote descriptors of a pull, adjacent blocks merged. */
export interface CoalescedDescs {
  local: BigUint64Array;
  remote: BigUint64Array;
  count: number;
}

/**
 * Descriptor pairs for the given blocks, one per run of adjacent blocks per
 * region when that region is contiguous on both sides (the slice spans the
 * whole block stride), else one per block. Returns undefined when nothing
 * would merge, so callers keep the prepped lists.
 */
export function coalescedDescs(
  local: BlockSlices,
  remote: BlockSlices,
  localIds: ArrayLike<number>,
  remoteIds: ArrayLike<number>,
): CoalescedDescs | undefined {
  const regions = local.baseAddrs.length;
  const runs = adjacentRuns(localIds, remoteIds);
  const mergeable = Array.from(
    { length: regions },
    (_, r) =>
      local.offsets[r] === 0 &&
      local.lens[r] === local.strides[r] &&
      remote.offsets[r] === 0 &&
      remote.lens[r] === remote.strides[r],
  );
  if (runs.length === localIds.length || !mergeable.some(Boolean)) return undefined;
  let count = 0;
  for (let r = 0; r < regions; r++) count += mergeable[r] ? runs.length : localIds.length;
  const L = new BigUint64Array(count * 3);
  const R = new BigUint64Array(count * 3);
  const ld = BigInt(local.devId);
  const rd = BigInt(remote.devId);
  let k = 0;
  const put = (r: number, li: number, ri: number, blocks: number) => {
    const len = BigInt(local.lens[r] * blocks);
    L[k] = local.baseAddrs[r] + BigInt(local.offsets[r]) + BigInt(li) * BigInt(local.strides[r]);
    R[k] = remote.baseAddrs[r] + BigInt(remote.offsets[r]) + BigInt(ri) * BigInt(remote.strides[r]);
    L[k + 1] = len;
    R[k + 1] = len;
    L[k + 2] = ld;
    R[k + 2] = rd;
    k += 3;
  };
  for (let r = 0; r < regions; r++) {
    if (mergeable[r]) {
      for (const [s, e] of runs) put(r, localIds[s], remoteIds[s], e - s);
    } else {
      for (let i = 0; i < localIds.length; i++) put(r, localIds[i], remoteIds[i], 1);
    }
  }
  return { local: L, remote: R, count };
}
