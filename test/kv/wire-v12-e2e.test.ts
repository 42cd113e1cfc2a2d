// vLLM v12 semantics end to end on the loopback engine, in one process: a
// prefill with two pipeline ranks (two layers each) in the BLHNC layout
// (block stride = layers x block len), 2 kernel blocks per logical block;
// a decode pulls straight from kv_transfer_params, every byte checked; both
// pipeline ranks' trackers free the blocks; heartbeats keep a waiting
// request's lease.
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import {
  DescList,
  KvPuller,
  NixlAgent,
  PrefillTracker,
  allocate,
  buildKvTransferParams,
  servePrefill,
  type KvLayout,
} from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';

const BLOCK = 4096; // bytes of one layer's block
const KERNEL_BLOCKS = 8;
const R = 2; // kernel blocks per logical block
const LAYERS = 4;
const quiet = { warn() {} };

/** BLHNC: [block][layer][block bytes]; region i = layer i, stride = layers x block. */
function layout(engineId: string, mem: Buffer, layers: number, extra: Partial<KvLayout> = {}): KvLayout {
  const base = DescList.from(mem).addr(0);
  return {
    engineId,
    tpSize: 1,
    tpRank: 0,
    numBlocks: KERNEL_BLOCKS,
    blockSize: 16,
    blockLens: Array(layers).fill(BLOCK),
    blockStrides: Array(layers).fill(layers * BLOCK),
    baseAddrs: Array.from({ length: layers }, (_, i) => base + BigInt(i * BLOCK)),
    kvCacheLayout: 'BLHNC',
    physicalBlocksPerLogical: R,
    totalNumKvHeads: 8,
    regionNames: Array.from({ length: layers }, (_, i) => `model.layers.${i}.self_attn`),
    ...extra,
  };
}

let P: NixlAgent[], D: NixlAgent, pmem: Buffer[], dmem: Buffer, server: HandshakeServer, trackers: PrefillTracker[];

beforeEach(async () => {
  P = [0, 1].map((pp) => new NixlAgent(`v12-P-pp${pp}`, { engine: 'loopback' }));
  D = new NixlAgent('v12-D', { engine: 'loopback' });
  pmem = [0, 1].map((pp) => {
    const m = allocate(KERNEL_BLOCKS * 2 * BLOCK);
    // Byte = f(pp, layer, kernel block): every block of every layer differs.
    for (let b = 0; b < KERNEL_BLOCKS; b++)
      for (let l = 0; l < 2; l++)
        m.fill((pp * 64 + l * 16 + b + 1) & 0xff, (b * 2 + l) * BLOCK, (b * 2 + l + 1) * BLOCK);
    P[pp].registerMemory(m);
    return m;
  });
  dmem = allocate(KERNEL_BLOCKS * LAYERS * BLOCK);
  D.registerMemory(dmem);
  server = await servePrefill({
    ranks: [0, 1].map((pp) => ({
      agent: P[pp],
      layout: {
        ...layout('prefill', pmem[pp], 2),
        ppRank: pp,
        ppSize: 2,
        regionNames: [0, 1].map((l) => `model.layers.${pp * 2 + l}.self_attn`),
      },
    })),
    compatibilityHash: 'h12',
    port: 0,
    wire: 'v12',
    logger: quiet,
  });
  trackers = P.map((agent) => new PrefillTracker({ agent, tpSize: 1, wire: 'v12', logger: quiet }));
});

afterEach(async () => {
  for (const t of trackers) await t.close();
  await server.close();
  for (const a of [...P, D]) a.close();
});

describe('v12 end to end (loopback)', () => {
  it('pullFromParams: every pipeline rank, strided regions, logical ids expanded, both trackers freed', async () => {
    const released = trackers.map((t) => t.expect('cmpl-1', [2, 3, 6, 7]));
    const params = buildKvTransferParams(
      {
        remoteBlockIds: [[1, 3]], // logical -> kernel 2,3 and 6,7
        remoteEngineId: 'prefill',
        remoteRequestId: 'cmpl-1',
        remoteHost: '127.0.0.1',
        remotePort: server.basePort,
        tpSize: 1,
        ppSize: 2,
        remoteNumTokens: 64,
      },
      'v12',
    );
    const puller = new KvPuller({ agent: D, layout: layout('decode', dmem, LAYERS), expectedHash: 'h12', wire: 'v12' });
    const r = await puller.pullFromParams(JSON.parse(JSON.stringify(params)), { localBlockIds: [0, 2] });
    expect(r.bytes).toBe(4 * LAYERS * BLOCK);
    // local logical 0,2 -> kernel 0,1,4,5 <- remote kernel 2,3,6,7
    const pairs = [
      [0, 2],
      [1, 3],
      [4, 6],
      [5, 7],
    ];
    for (const [lb, rb] of pairs) {
      for (let layer = 0; layer < LAYERS; layer++) {
        const pp = layer >> 1;
        const want = (pp * 64 + (layer & 1) * 16 + rb + 1) & 0xff;
        const at = (lb * LAYERS + layer) * BLOCK;
        const got = dmem.subarray(at, at + BLOCK);
        expect(
          got.every((x) => x === want),
          `local block ${lb} layer ${layer}`,
        ).toBe(true);
      }
    }
    // Blocks not asked for stay untouched.
    expect(dmem.subarray(2 * LAYERS * BLOCK, 4 * LAYERS * BLOCK).every((x) => x === 0)).toBe(true);
    for (const p of released) expect(await p).toMatchObject({ requestId: 'cmpl-1', reason: 'read' });
    expect(
      await puller.clockOffset({
        host: '127.0.0.1',
        port: server.basePort,
        tpSize: 1,
        ppSize: 2,
        dcpSize: 1,
        engineId: 'prefill',
      }),
    ).toEqual(expect.any(Number));
    await puller.close();
  });

  it('refuses what vLLM refuses, naming the field: layout, region names, engine id', async () => {
    const base = {
      remoteBlockIds: [[0]],
      remoteEngineId: 'prefill',
      remoteRequestId: 'x',
      remoteHost: '127.0.0.1',
      remotePort: server.basePort,
      tpSize: 1,
      ppSize: 2,
    };
    const tryPull = async (l: KvLayout, p: Partial<typeof base> = {}) => {
      const puller = new KvPuller({ agent: D, layout: l, wire: 'v12' });
      try {
        return await puller
          .pullFromParams(buildKvTransferParams({ ...base, ...p }, 'v12'), { localBlockIds: [0] })
          .catch((e) => e);
      } finally {
        await puller.close();
      }
    };
    expect(await tryPull({ ...layout('decode', dmem, LAYERS), kvCacheLayout: 'LBHNC' })).toMatchObject({
      kind: 'handshake',
      message: expect.stringMatching(/kv_cache_layout: remote BLHNC, local LBHNC/),
    });
    const renamed = layout('decode', dmem, LAYERS, { regionNames: ['a', 'b', 'c', 'd'] });
    expect(await tryPull(renamed)).toMatchObject({
      message: expect.stringMatching(/region_names\[0\]: remote model.layers.0.self_attn, local a/),
    });
    expect(await tryPull(layout('decode', dmem, LAYERS), { remoteEngineId: 'other' })).toMatchObject({
      message: expect.stringMatching(/engine_id: .* sent 'prefill', kv_transfer_params named 'other'/),
    });
    expect(await tryPull(layout('decode', dmem, LAYERS), { ppSize: 1 })).toMatchObject({
      message: expect.stringMatching(/kv_caches_base_addr \(regions\): remote 2, local 4/),
    });
    const push = await tryPull(layout('decode', dmem, LAYERS));
    expect(push.bytes).toBe(R * LAYERS * BLOCK); // the good one works
  });

  it('heartbeats keep a waiting request alive at the prefill, and stop when it is released', async () => {
    const t = new PrefillTracker({ agent: P[0], tpSize: 1, wire: 'v12', leaseMs: 600, logger: quiet });
    const tracked = t.expect('waiting', [1]);
    let freed: string | undefined;
    void tracked.then((r) => (freed = r.reason));
    const puller = new KvPuller({ agent: D, layout: layout('decode', dmem, LAYERS), wire: 'v12', kvLeaseMs: 600 });
    const ep = { host: '127.0.0.1', port: server.basePort, tpSize: 1, ppSize: 2 };
    const stop = puller.holdRemote(ep, 'waiting');
    await new Promise((r) => setTimeout(r, 1500)); // 2.5 leases
    expect(freed).toBeUndefined();
    expect(t.heartbeats).toBeGreaterThanOrEqual(5);
    expect(puller.heartbeatsSent).toBeGreaterThanOrEqual(5);
    stop();
    const sent = puller.heartbeatsSent;
    await new Promise((r) => setTimeout(r, 1000));
    expect(freed).toBe('expired');
    expect(puller.heartbeatsSent).toBe(sent);
    await t.close();
    await puller.close();
  });
});
