// The TP mapping, table-driven against vLLM's rules.
import { describe, expect, it } from 'vitest';
import { wireV12, wireV013, type NixlAgentMetadata } from '../../lib/handshake';
import { absentMetadataFields } from '../../lib/handshake/model';
import {
  KvLayoutError,
  consumersPerProducer,
  expectedConsumers,
  isKvReplicated,
  planReads,
  targetRemoteRanks,
  tpRatio,
  type KvLayout,
} from '../../lib/kv';
import { completionNotif, handshakeTargets, notifsToWaitFor } from '../../lib/kv/tp';

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
    blockStrides: [blockLen, blockLen],
    kvCacheLayout: 'LBHNC',
    blockSize: 16,
    ...absentMetadataFields(),
    attnBackendName: 'FLASH_ATTN',
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
        ppRank: 0,
        regionStart: 0,
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

  it('refuses metadata vLLM refuses, naming the field and both values (spec section 4)', () => {
    const bad = (l: KvLayout, tp: number, r: NixlAgentMetadata, re: RegExp, code = 'NIXL_ERR_MISMATCH') =>
      expect(() => planReads(l, tp, r)).toThrow(expect.objectContaining({ code, message: expect.stringMatching(re) }));
    expect(() => tpRatio(3, 2)).toThrow(KvLayoutError);
    expect(() => tpRatio(2, 3)).toThrow(/not a multiple/);
    bad(local(2, 0), 1, remote(1, 8, false, { kvCacheLayout: 'LBNHC' }), /kv_cache_layout: remote LBNHC, local LBHNC/);
    bad(
      local(2, 0),
      1,
      remote(1, 8, false, { blockLens: [HEAD, HEAD] }),
      /block_lens\[0\]: remote 1024, local 4096 .*tp_ratio 2/,
    );
    bad(
      local(1, 0),
      2,
      remote(2, 8, false, { blockLens: [HEAD, HEAD] }),
      /block_lens\[0\]: remote 1024, local 8192 .*\/ 2/,
    );
    bad(
      local(1, 0),
      1,
      remote(1, 8, false, { blockLens: [8 * HEAD, 4 * HEAD] }),
      /block_lens\[1\]: remote 4096, local 8192/,
    );
    bad(local(1, 0), 1, remote(1, 8, false, { blockSize: 24 }), /block_size: remote 24, local 16/);
    bad(local(1, 0), 1, remote(1, 8, false, { blockSize: 8 }), /block size ratio of 2/, 'NIXL_ERR_NOT_SUPPORTED');
    bad(
      local(1, 0),
      1,
      remote(1, 8, false, { kvCachesBaseAddr: [1n] }),
      /kv_caches_base_addr \(regions\): remote 1, local 2/,
    );
    bad(local(2, 0, 8, false, 'NHD'), 1, remote(1, 8, false, { kvCacheLayout: 'LBNHC' }), /heads-major layout/);
    bad(
      local(2, 0, 8, true),
      1,
      remote(1, 8, true, { blockLens: [4096, 2048] }),
      /block_lens\[1\]: remote 2048, local 4096/,
    );
    bad(
      local(1, 0),
      1,
      remote(1, 8, false, { blockStrides: [8 * HEAD, 4 * HEAD] }),
      /block_strides\[1\] 4096 is below block_lens\[1\] 8192/,
    );
    bad(
      local(1, 0),
      1,
      remote(1, 8, false, { blockStrides: [8 * HEAD] }),
      /block_strides \(entries\): remote 1, local 2/,
    );
    bad(local(1, 0), 1, remote(1, 8, false, { regionNumBlocks: [5] }), /region_num_blocks \(entries\)/);
    bad(local(1, 0), 1, remote(1, 8, false, { regionGroupIds: [0, 0, 0] }), /region_group_ids \(entries\): remote 3/);
    bad(
      local(1, 0),
      1,
      remote(1, 8, false, { regionMemTypes: ['VRAM', 'DRAM'] }),
      /mixed-memory/,
      'NIXL_ERR_NOT_SUPPORTED',
    );
    bad(local(1, 0), 1, remote(1, 8, false, { ssmSizes: [4, 8] }), /ssm_sizes \[4, 8\]/, 'NIXL_ERR_NOT_SUPPORTED');
    bad(local(1, 0), 1, remote(1, 8, false, { dcpSize: 2 }), /dcp_size: remote 2, local 1/);
    const named = { ...local(1, 0), regionNames: ['layers.0', 'layers.1'] };
    bad(
      named,
      1,
      remote(1, 8, false, { regionNames: ['layers.0', 'layers.2'] }),
      /region_names\[1\]: remote layers.2, local layers.1/,
    );
    expect(planReads(named, 1, remote(1, 8, false, { regionNames: ['layers.0', 'layers.1'] })).reads).toHaveLength(1);
    expect(planReads(named, 1, remote(1, 8, false, { regionNames: null })).reads).toHaveLength(1);
    expect(() => tpRatio(3, 2)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_MISMATCH' }));
  });

  it('pipeline ranks: each maps to the next of our regions, and handshake targets are only real ranks', () => {
    const l = { ...local(2, 1), baseAddrs: [1n, 2n, 3n, 4n], blockLens: Array(4).fill(4 * HEAD) };
    const r = (n: number) =>
      remote(1, 8, false, {
        kvCachesBaseAddr: Array(n).fill(0x9000n),
        blockLens: Array(n).fill(8 * HEAD),
        blockStrides: Array(n).fill(8 * HEAD),
      });
    const p1 = planReads(l, 1, r(3), { ppRank: 1, regionStart: 1 });
    expect(p1.reads[0]).toMatchObject({ ppRank: 1, regionStart: 1, remoteOffset: [4 * HEAD, 4 * HEAD, 4 * HEAD] });
    expect(() => planReads(l, 1, r(4), { ppRank: 1, regionStart: 1 })).toThrow(/regions\): remote 4, local 3/);
    expect(handshakeTargets(4, 3, { tpSize: 2, ppSize: 2 })).toEqual([
      { ppRank: 0, tpRank: 1 },
      { ppRank: 1, tpRank: 1 },
    ]);
    expect(handshakeTargets(2, 1, { tpSize: 4 })).toEqual([
      { ppRank: 0, tpRank: 2 },
      { ppRank: 0, tpRank: 3 },
    ]);
    expect(() => handshakeTargets(2, 1, { tpSize: 4, dcpSize: 2 })).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_NOT_SUPPORTED' }),
    );
  });

  it('completion notifications: v0.13 sends the decode TP size, v12 the count the prefill rank waits for', () => {
    // D_tp 4 reading P_tp 2: each P rank is read by 2 D ranks.
    expect(completionNotif(wireV013, 'req-1', 4, 2)).toBe('req-1:4');
    expect(completionNotif(wireV12, 'req-1', 4, 2)).toBe('req-1:2');
    expect(completionNotif(wireV12, 'req:with:colons', 2, 4)).toBe('req:with:colons:1');
    expect(notifsToWaitFor(wireV013, 4, 2)).toBe(2);
    expect(notifsToWaitFor(wireV12, 2, 2)).toBe(2);
    expect(notifsToWaitFor(wireV12, 0, 2)).toBe(1);
    // DCP rules (vLLM's dcp_consumer_count).
    expect(expectedConsumers(4, 2, 1, 2)).toBe(4);
    expect(expectedConsumers(4, 2, 4, 2)).toBe(2);
    expect(expectedConsumers(4, 2, 1, 4)).toBe(4);
    expect(expectedConsumers(2, 8)).toBe(1);
  });
});
