// The TP mapping, table-driven against vLLM's rules.
import { describe, expect, it } from 'vitest';
import type { NixlAgentMetadata } from '../lib/handshake/codec';
import {
  KvLayoutError,
  consumersPerProducer,
  isKvReplicated,
  planReads,
  targetRemoteRanks,
  tpRatio,
  type KvLayout,
} from '../lib/kv';

const HEAD = 1024; // bytes per KV head per block

function local(tpSize: number, tpRank: number, heads = 8, mla = false, layout: 'HND' | 'NHD' = 'HND'): KvLayout {
  const blockLen = mla ? 4096 : (heads / tpSize) * HEAD;
  return {
    engineId: 'D',
    tpSize,
    tpRank,
    numBlocks: 100,
    blockSize: 16,
    blockLens: [blockLen, blockLen],
    baseAddrs: [0x1000n, 0x100000n],
    kvCacheLayout: layout,
    isMla: mla,
    totalNumKvHeads: heads,
  };
}

function remote(tpSize: number, heads = 8, mla = false, over: Partial<NixlAgentMetadata> = {}): NixlAgentMetadata {
  const blockLen = mla ? 4096 : Math.max(1, heads / tpSize) * HEAD;
  return {
    engineId: 'P',
    agentMetadata: Buffer.alloc(0),
    kvCachesBaseAddr: [0x9000n, 0x90000n],
    deviceId: 0,
    numBlocks: 50,
    blockLens: [blockLen, blockLen],
    kvCacheLayout: 'HND',
    blockSize: 16,
    ...over,
  };
}

// [name, P tp, D tp, D rank, ratio, remote ranks, local slices [offset,len], remote offsets, notifyOnly]
const table: Array<
  [string, number, number, number, number, number[], Array<[number, number]>, number[], boolean[], boolean?]
> = [
  ['1:1', 1, 1, 0, 1, [0], [[0, 16 * HEAD]], [0], [false]],
  ['P1 -> D2, rank 1', 1, 2, 1, 2, [0], [[0, 8 * HEAD]], [8 * HEAD], [false]],
  ['P1 -> D4, rank 3', 1, 4, 3, 4, [0], [[0, 4 * HEAD]], [3 * 4 * HEAD], [false]],
  ['P2 -> D4, rank 2', 2, 4, 2, 2, [1], [[0, 4 * HEAD]], [0], [false]],
  ['P2 -> D4, rank 3', 2, 4, 3, 2, [1], [[0, 4 * HEAD]], [4 * HEAD], [false]],
  [
    'P4 -> D2, rank 1',
    4,
    2,
    1,
    -2,
    [2, 3],
    [
      [0, 4 * HEAD],
      [4 * HEAD, 4 * HEAD],
    ],
    [0, 0],
    [false, false],
  ],
  [
    'P8 -> D2, rank 0',
    8,
    2,
    0,
    -4,
    [0, 1, 2, 3],
    [
      [0, 2 * HEAD],
      [2 * HEAD, 2 * HEAD],
      [4 * HEAD, 2 * HEAD],
      [6 * HEAD, 2 * HEAD],
    ],
    [0, 0, 0, 0],
    [false, false, false, false],
  ],
  ['MLA P2 -> D4, rank 3', 2, 4, 3, 2, [1], [[0, 4096]], [0], [false], true],
  [
    'MLA P4 -> D2, rank 1',
    4,
    2,
    1,
    -2,
    [2, 3],
    [
      [0, 4096],
      [0, 4096],
    ],
    [0, 0],
    [false, true],
    true,
  ],
];

describe('TP mapping (vLLM rules)', () => {
  it.each(table)('%s', (_n, pTp, dTp, rank, ratio, ranks, slices, offsets, notifyOnly, mla = false) => {
    expect(tpRatio(dTp, pTp)).toBe(ratio);
    expect(targetRemoteRanks(dTp, rank, pTp)).toEqual(ranks);
    const plan = planReads(local(dTp, rank, 16, mla), pTp, remote(pTp, 16, mla)); // 16 KV heads
    expect(plan.tpRatio).toBe(ratio);
    expect(plan.reads.map((r) => r.remoteRank)).toEqual(ranks);
    plan.reads.forEach((r, i) => {
      expect(r.local[0]).toEqual({ offset: slices[i][0], len: slices[i][1] });
      expect(r.local[1]).toEqual(r.local[0]); // same per region
      expect(r.remoteOffset[0]).toBe(offsets[i]);
      expect(r.notifyOnly).toBe(notifyOnly[i]);
    });
  });

  it('replicated KV (TP >= KV heads) reads whole blocks from one rank', () => {
    expect(isKvReplicated(4, 4)).toBe(true);
    expect(isKvReplicated(2, 4)).toBe(false);
    // 2 KV heads, P TP=2 (replicated), D TP=4: every D rank reads the whole block of P rank r//2
    const l = { ...local(4, 3, 2), blockLens: [HEAD, HEAD] };
    const plan = planReads(l, 2, remote(2, 2));
    expect(plan.replicated).toBe(true);
    expect(plan.reads).toEqual([
      {
        remoteRank: 1,
        local: [
          { offset: 0, len: HEAD },
          { offset: 0, len: HEAD },
        ],
        remoteOffset: [0, 0],
        notifyOnly: false,
      },
    ]);
    expect(() => planReads({ ...local(1, 0, 2), blockLens: [HEAD, HEAD] }, 2, remote(2, 2))).toThrow(
      /replicated KV cache/,
    );
  });

  it('the prefill side waits for decode_tp / prefill_tp reads when decode TP is larger', () => {
    expect(consumersPerProducer(2, 4)).toBe(2);
    expect(consumersPerProducer(4, 2)).toBe(1);
    expect(consumersPerProducer(2, 2)).toBe(1);
  });

  it('refuses layouts that cannot be read, saying why', () => {
    expect(() => tpRatio(3, 2)).toThrow(KvLayoutError);
    expect(() => tpRatio(2, 3)).toThrow(/not a multiple/);
    expect(() => planReads(local(2, 0), 1, remote(1, 8, false, { kvCacheLayout: 'NHD' }))).toThrow(
      /layout NHD differs/,
    );
    expect(() => planReads(local(2, 0), 1, remote(1, 8, false, { blockLens: [HEAD, HEAD] }))).toThrow(/x tp_ratio 2/);
    expect(() => planReads(local(1, 0), 2, remote(2, 8, false, { blockLens: [HEAD, HEAD] }))).toThrow(/\/ 2/);
    expect(() => planReads(local(1, 0), 1, remote(1, 8, false, { blockLens: [8 * HEAD, 4 * HEAD] }))).toThrow(
      /same block len/,
    );
    expect(() => planReads(local(1, 0), 1, remote(1, 8, false, { blockSize: 32 }))).toThrow(/block size 32/);
    expect(() => planReads(local(1, 0), 1, remote(1, 8, false, { kvCachesBaseAddr: [1n] }))).toThrow(/1 KV regions/);
    expect(() => planReads(local(2, 0, 8, false, 'NHD'), 1, remote(1, 8, false, { kvCacheLayout: 'NHD' }))).toThrow(
      /needs the HND layout/,
    );
    expect(() => planReads(local(2, 0, 8, true), 1, remote(1, 8, true, { blockLens: [4096, 2048] }))).toThrow(
      /must match when replicated/,
    );
    expect(() => tpRatio(3, 2)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_MISMATCH' }));
  });
});
