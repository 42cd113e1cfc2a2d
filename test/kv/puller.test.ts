// KvPuller and PrefillTracker in one process: limits, timeouts, aborts,
// prefix hits, stats, and that no handle outlives its pull.
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import {
  DescList,
  KvPuller,
  NixlAgent,
  NixlError,
  PrefillTracker,
  allocate,
  servePrefill,
  type KvLayout,
} from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';

const BLOCK = 1 << 20;
const BLOCKS = 48;
const quiet = { warn() {} };

function layout(engineId: string, mem: Buffer): KvLayout {
  const base = DescList.from(mem).addr(0);
  return {
    engineId,
    tpSize: 1,
    tpRank: 0,
    numBlocks: BLOCKS,
    blockSize: 16,
    blockLens: [BLOCK, BLOCK],
    baseAddrs: [base, base + BigInt(BLOCK * BLOCKS)],
    kvCacheLayout: 'HND',
    totalNumKvHeads: 8,
  };
}

let prefill: NixlAgent, decode: NixlAgent, server: HandshakeServer, tracker: PrefillTracker, puller: KvPuller;
let pmem: Buffer, dmem: Buffer;
const remote = () => ({ host: '127.0.0.1', port: server.basePort, tpSize: 1 });

beforeEach(async () => {
  prefill = new NixlAgent('pp', { engine: 'loopback' });
  decode = new NixlAgent('dd', { engine: 'loopback' });
  pmem = allocate(2 * BLOCK * BLOCKS);
  for (let i = 0; i < pmem.length; i += 4096) pmem[i] = (i / 4096) & 0xff;
  dmem = allocate(2 * BLOCK * BLOCKS);
  prefill.registerMemory(pmem);
  decode.registerMemory(dmem);
  server = await servePrefill({
    ranks: [{ agent: prefill, layout: layout('P', pmem) }],
    compatibilityHash: 'h',
    port: 0,
    logger: quiet,
  });
  tracker = new PrefillTracker({ agent: prefill, tpSize: 1, expireMs: 5000, logger: quiet });
  puller = new KvPuller({ agent: decode, layout: layout('D', dmem), expectedHash: 'h', maxConcurrent: 1 });
});

afterEach(async () => {
  await puller.close();
  await tracker.close();
  await server.close();
  prefill.close();
  decode.close();
});

describe('KvPuller', () => {
  it('pulls, reports stats like vLLM, and frees the prefill blocks', async () => {
    const released = tracker.expect('r1', [1, 2, 3]);
    const r = await puller.pullBlocks({
      remote: remote(),
      localBlockIds: [0, 1, 2],
      remoteBlockIds: [1, 2, 3],
      requestId: 'r1',
      coalesce: true,
    });
    expect(r.bytes).toBe(2 * 3 * BLOCK);
    expect(r.descriptors).toBe(2); // one run per region, coalesced
    expect(r.coalesced).toBe(true);
    expect(dmem.subarray(0, 3 * BLOCK).equals(pmem.subarray(BLOCK, 4 * BLOCK))).toBe(true);
    expect(await released).toEqual({ requestId: 'r1', blockIds: [1, 2, 3], reason: 'read' });
    const s = puller.stats.snapshot();
    expect(s).toMatchObject({ transfers: 1, failedTransfers: 0, bytesTransferred: 6 * BLOCK, descriptors: 2 });
    expect(s.transferTimeMs.count).toBe(1);
    const text = puller.stats.prometheus({ engine: 'D' });
    expect(text).toMatch(/^nixl_node_bytes_transferred_total\{engine="D"\} 6291456$/m);
    expect(text).toMatch(/^nixl_node_transfer_seconds_bucket\{engine="D",le="\+Inf"\} 1$/m);
    const uncoalesced = await puller.pullBlocks({
      remote: remote(),
      localBlockIds: [0, 1, 2],
      remoteBlockIds: [1, 2, 3],
      requestId: 'r2',
    });
    expect(uncoalesced.descriptors).toBe(6);
    expect(puller.resources()).toMatchObject({ xferHandles: 0, activePulls: 0, engines: 1 });
  });

  it('a full prefix hit only notifies, so the prefill side frees its blocks', async () => {
    const released = tracker.expect('hit', [4, 5]);
    const r = await puller.pullBlocks({
      remote: remote(),
      localBlockIds: [],
      remoteBlockIds: [4, 5],
      requestId: 'hit',
    });
    expect(r.bytes).toBe(0);
    expect((await released).reason).toBe('read');
  });

  it('requests nobody reads expire', async () => {
    const t = new PrefillTracker({ agent: prefill, tpSize: 1, expireMs: 30, logger: quiet });
    expect(await t.expect('never', [1])).toMatchObject({ reason: 'expired' });
    await t.close();
  });

  it('limits pulls in flight across requests', async () => {
    const pulls = [0, 1, 2].map((i) =>
      puller.pullBlocks({
        remote: remote(),
        localBlockIds: [i * 10, i * 10 + 1],
        remoteBlockIds: [i, i + 20],
        requestId: `c${i}`,
      }),
    );
    expect(puller.resources().activePulls).toBe(1);
    await Promise.all(pulls);
    expect(puller.resources()).toMatchObject({ activePulls: 0, xferHandles: 0 });
  });

  it('a timeout rejects with the local blocks to recompute, and releases everything', async () => {
    decode.close();
    decode = new NixlAgent('dd', { engine: 'loopback', testDelayUs: 300_000 }); // every transfer held 300 ms
    decode.registerMemory(dmem);
    await puller.close();
    puller = new KvPuller({ agent: decode, layout: layout('D', dmem), expectedHash: 'h', maxConcurrent: 1 });
    await puller.connect(remote());
    const ids = Array.from({ length: BLOCKS }, (_, i) => i);
    const err = await puller
      .pullBlocks({ remote: remote(), localBlockIds: ids, remoteBlockIds: ids, requestId: 'slow', timeoutMs: 50 })
      .catch((e) => e);
    expect(err).toMatchObject({
      name: 'PullError',
      kind: 'timeout',
      code: 'NIXL_ERR_TIMEOUT',
      requestId: 'slow',
      localBlockIds: ids,
    });
    expect(puller.resources()).toMatchObject({ xferHandles: 0, activePulls: 0 });
    expect(puller.stats.snapshot().failedTransfers).toBe(1);
  });

  it('an abort rejects as kind aborted', async () => {
    const ac = new AbortController();
    const p = puller.pullBlocks({
      remote: remote(),
      localBlockIds: [1, 2],
      remoteBlockIds: [3, 4],
      requestId: 'ab',
      signal: ac.signal,
    });
    ac.abort();
    await expect(p).rejects.toMatchObject({ kind: 'aborted', localBlockIds: [1, 2] });
    expect(puller.resources().xferHandles).toBe(0);
  });

  it('a compatibility hash mismatch fails the handshake with NIXL_ERR_MISMATCH', async () => {
    const other = new KvPuller({ agent: decode, layout: layout('D2', dmem), expectedHash: 'other' });
    await expect(
      other.pullBlocks({ remote: remote(), localBlockIds: [1], remoteBlockIds: [1], requestId: 'm' }),
    ).rejects.toMatchObject({ kind: 'handshake', code: 'NIXL_ERR_MISMATCH', localBlockIds: [1] });
    await other.close();
  });
});

describe('metrics in prom-client', () => {
  it("the puller's and the tracker's counters and histograms land in the caller's Registry", async () => {
    const { Registry } = await import('prom-client');
    const { registerKvMetrics } = await import('../../lib');
    const registry = new Registry();
    const stop = registerKvMetrics(registry, { puller, tracker, labels: { rank: '0' } });
    const released = tracker.expect('m1', [4, 5]);
    await puller.pullBlocks({ remote: remote(), localBlockIds: [0, 1], remoteBlockIds: [4, 5], requestId: 'm1' });
    await released;
    await expect(
      puller.pullBlocks({ remote: remote(), localBlockIds: [0], remoteBlockIds: [999], requestId: 'm2' }),
    ).rejects.toMatchObject({ kind: 'setup' });
    const text = await registry.metrics();
    expect(text).toMatch(/^nixl_node_transfers_total\{rank="0"\} 1$/m);
    expect(text).toMatch(/^nixl_node_failed_transfers_total\{rank="0"\} 1$/m);
    expect(text).toMatch(new RegExp(`^nixl_node_bytes_transferred_total\\{rank="0"\\} ${2 * 2 * BLOCK}$`, 'm'));
    expect(text).toMatch(/^nixl_node_transfer_seconds_count\{rank="0"\} 1$/m);
    expect(text).toMatch(/^nixl_node_post_seconds_bucket\{le="\+Inf",rank="0"\} 1$/m);
    expect(text).toMatch(/^nixl_node_prefill_released_total\{rank="0",reason="read"\} 1$/m);
    expect(text).toMatch(/^nixl_node_prefill_hold_seconds_count\{rank="0"\} 1$/m);
    expect(text).toMatch(/^nixl_node_prefill_pending_requests\{rank="0"\} 0$/m);
    stop();
    await puller.pullBlocks({ remote: remote(), localBlockIds: [2], remoteBlockIds: [6], requestId: 'm3' });
    expect(await registry.metrics()).toMatch(/^nixl_node_transfers_total\{rank="0"\} 1$/m);
    // The text format without prom-client goes on counting.
    expect(puller.stats.prometheus({ rank: '0' })).toMatch(/^nixl_node_transfers_total\{rank="0"\} 2$/m);
  });
});

describe('KvPuller, a peer that goes away between the handshake and the post', () => {
  it("NIXL's NOT_FOUND from making the transfer is the peer's fault: peer-gone, handshake afresh, the next pull works", async () => {
    // NIXL answers makeXferReq with NIXL_ERR_NOT_FOUND once a dead peer's
    // connection is torn down; the puller had reported it as a 400-class
    // 'setup' failure. The ids were checked first, so it cannot be the request's.
    let failNext = true;
    const flaky = new Proxy(decode, {
      get(target, prop) {
        if (prop === 'makePreppedXfer' && failNext)
          return () => {
            failNext = false;
            throw new NixlError('makeXferReq: NIXL_ERR_NOT_FOUND', 'NIXL_ERR_NOT_FOUND');
          };
        const v = Reflect.get(target, prop, target);
        return typeof v === 'function' ? v.bind(target) : v;
      },
    });
    const p2 = new KvPuller({ agent: flaky, layout: layout('D', dmem), expectedHash: 'h' });
    try {
      const err = await p2
        .pullBlocks({ remote: remote(), localBlockIds: [0], remoteBlockIds: [1], requestId: 'gone-1' })
        .catch((e) => e);
      expect(err).toMatchObject({ kind: 'peer-gone', code: 'NIXL_ERR_NOT_FOUND', localBlockIds: [0] });
      expect(p2.resources().engines).toBe(0); // forgotten: the next pull handshakes afresh
      const released = tracker.expect('ok-2', [2]);
      const r = await p2.pullBlocks({ remote: remote(), localBlockIds: [1], remoteBlockIds: [2], requestId: 'ok-2' });
      expect(r.bytes).toBe(2 * BLOCK);
      expect((await released).reason).toBe('read');
    } finally {
      await p2.close();
    }
  });
});
