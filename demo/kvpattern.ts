// A synthetic KV cache in which every byte says where it came from: region,
// block, global KV head and offset. A decode rank can then check the exact
// slice it pulled, whatever the TP layout. Rows are memcpy'd from 256
// precomputed templates, so filling and checking GiBs stays quick.

export interface KvSpec {
  /** Total KV heads of the model. */
  heads: number;
  /** Bytes of one head's slice of one block (block_size x head_dim x dtype). */
  headBytes: number;
  numBlocks: number;
  /** Regions: layers x 2 (K, V), or layers for MLA. */
  regions: number;
  tpSize: number;
  tpRank: number;
  /** MLA: one latent cache per layer, the same on every rank. */
  mla?: boolean;
}

export function rankDims(s: Pick<KvSpec, 'heads' | 'tpSize' | 'headBytes' | 'mla'>): {
  localHeads: number;
  blockLen: number;
} {
  if (!s.mla && s.heads % s.tpSize !== 0) throw new RangeError(`${s.heads} KV heads do not split over TP ${s.tpSize}`);
  const localHeads = s.mla ? 1 : s.heads / s.tpSize;
  return { localHeads, blockLen: localHeads * s.headBytes };
}

export function rankBytes(s: KvSpec): number {
  return rankDims(s).blockLen * s.numBlocks * s.regions;
}

const templates = new Map<number, Buffer[]>();

function rows(headBytes: number): Buffer[] {
  let t = templates.get(headBytes);
  if (!t) {
    t = Array.from({ length: 256 }, (_, c) => {
      const b = Buffer.allocUnsafe(headBytes);
      for (let i = 0; i < headBytes; i++) b[i] = (c + i * 7 + (i >>> 8)) & 0xff;
      return b;
    });
    templates.set(headBytes, t);
  }
  return t;
}

function rowId(region: number, block: number, globalHead: number): number {
  return (region * 131 + block * 31 + globalHead * 17) & 0xff;
}

function globalHead(s: KvSpec, h: number, localHeads: number): number {
  return s.mla ? 0 : s.tpRank * localHeads + h;
}

export function fillRank(mem: Buffer, s: KvSpec): void {
  const { localHeads, blockLen } = rankDims(s);
  const t = rows(s.headBytes);
  const regionBytes = blockLen * s.numBlocks;
  for (let r = 0; r < s.regions; r++) {
    for (let b = 0; b < s.numBlocks; b++) {
      const base = r * regionBytes + b * blockLen;
      for (let h = 0; h < localHeads; h++)
        t[rowId(r, b, globalHead(s, h, localHeads))].copy(mem, base + h * s.headBytes);
    }
  }
}

/** Mismatching head rows after local block localIds[k] was pulled from remote block remoteIds[k]. */
export function verifyRank(mem: Buffer, s: KvSpec, localIds: ArrayLike<number>, remoteIds: ArrayLike<number>): number {
  const { localHeads, blockLen } = rankDims(s);
  const t = rows(s.headBytes);
  const regionBytes = blockLen * s.numBlocks;
  let bad = 0;
  for (let r = 0; r < s.regions; r++) {
    for (let k = 0; k < localIds.length; k++) {
      const base = r * regionBytes + localIds[k] * blockLen;
      for (let h = 0; h < localHeads; h++) {
        const off = base + h * s.headBytes;
        if (!t[rowId(r, remoteIds[k], globalHead(s, h, localHeads))].equals(mem.subarray(off, off + s.headBytes)))
          bad++;
      }
    }
  }
  return bad;
}

/** The KvLayout fields for a rank whose regions lie back to back from addr. */
export function rankLayout(s: KvSpec, engineId: string, addr: bigint) {
  const { blockLen } = rankDims(s);
  const regionBytes = blockLen * s.numBlocks;
  return {
    engineId,
    tpSize: s.tpSize,
    tpRank: s.tpRank,
    numBlocks: s.numBlocks,
    blockSize: 16,
    blockLens: Array<number>(s.regions).fill(blockLen),
    baseAddrs: Array.from({ length: s.regions }, (_, i) => addr + BigInt(i * regionBytes)),
    kvCacheLayout: 'HND' as const,
    isMla: !!s.mla,
    totalNumKvHeads: s.heads,
  };
}
