// Push mode on the loopback engine, both roles in one process: a decode
// registers its blocks (KvPushReceiver), a prefill pairs the registration
// with a finished request and WRITEs (KvPushSender). Both orders, prefix
// trims, heterogeneous TP, and that the bytes that land are the prefill's.
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import {
  DescList,
  KvPushReceiver,
  KvPushSender,
  NixlAgent,
  PushError,
  allocate,
  computeCompatibilityHash,
  servePrefill,
  type KvLayout,
} from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';

const BLOCK = 4096;
const BLOCKS = 32;
const REGIONS = 2;
const quiet = { warn() {} };
export const PUSH_HASH = computeCompatibilityHash(
  {
    vllmVersion: 'nixl-node-test',
    model: 'm',
    dtype: 'torch.float16',
    numKvHeads: 8,
    headSize: 64,
    numHiddenLayers: REGIONS,
    attnBackendName: 'FLASH_ATTN',
    cacheDtype: 'auto',
    isHmaEnabled: false,
    transferMode: 'push',
  },
  'v12',
);

/** A layout of one rank over `mem`: REGIONS regions of BLOCKS blocks of `len` bytes. */
export function rankLayout(engineId: string, mem: Buffer, tp = 1, rank = 0, len = BLOCK): KvLayout {
  const base = DescList.from(mem).addr(0);
  return {
    engineId,
    tpSize: tp,
    tpRank: rank,
    numBlocks: BLOCKS,
    blockSize: 16,
    blockLens: Array(REGIONS).fill(len),
    baseAddrs: Array.from({ length: REGIONS }, (_, r) => base + BigInt(r * len * BLOCKS)),
    kvCacheLayout: 'LBHNC',
    totalNumKvHeads: 8,
  };
}

/** Block b of region r of a rank's memory. */
export const blockOf = (mem: Buffer, r: number, b: number, len = BLOCK) =>
  mem.subarray((r * BLOCKS + b) * len, (r * BLOCKS + b + 1) * len);

export function fill(mem: Buffer, seed: number): void {
  for (let i = 0; i < mem.length; i += 64) mem.writeUInt32LE((i * 2654435761 + seed) >>> 0, i);
}

let closers: Array<() => unknown>;
let pAgent: NixlAgent, dAgent: NixlAgent, pmem: Buffer, dmem: Buffer;
let pServer: HandshakeServer, dServer: HandshakeServer;
let sender: KvPushSender, receiver: KvPushReceiver;

const params = (o: Record<string, unknown> = {}) => ({
  do_remote_prefill: true,
  remote_engine_id: 'P',
  remote_request_id: 'router-1',
  remote_host: '127.0.0.1',
  remote_port: pServer.basePort,
  tp_size: 1,
  pp_size: 1,
  ...o,
});

beforeEach(async () => {
  closers = [];
  pAgent = new NixlAgent('push-p', { engine: 'loopback' });
  dAgent = new NixlAgent('push-d', { engine: 'loopback' });
  pmem = allocate(REGIONS * BLOCKS * BLOCK);
  dmem = allocate(REGIONS * BLOCKS * BLOCK);
  fill(pmem, 1);
  dmem.fill(0);
  pAgent.registerMemory(pmem);
  dAgent.registerMemory(dmem);
  const pLayout = rankLayout('P', pmem);
  const dLayout = rankLayout('D', dmem);
  pServer = await servePrefill({ ranks: [{ agent: pAgent, layout: pLayout }], compatibilityHash: PUSH_HASH, port: 0 });
  dServer = await servePrefill({ ranks: [{ agent: dAgent, layout: dLayout }], compatibilityHash: PUSH_HASH, port: 0 });
  sender = new KvPushSender({ agent: pAgent, layout: pLayout, expectedHash: PUSH_HASH, leaseMs: 5000, logger: quiet });
  receiver = new KvPushReceiver({
    agent: dAgent,
    layout: dLayout,
    decodeHost: '127.0.0.1',
    decodePort: dServer.basePort,
    expectedHash: PUSH_HASH,
    kvLeaseMs: 5000,
    timeoutMs: 5000,
  });
});

afterEach(async () => {
  for (const c of closers.reverse()) await c();
  await receiver.close();
  await sender.close();
  await pServer.close();
  await dServer.close();
  pAgent.close();
  dAgent.close();
});

const sameBlocks = (pIds: number[], dIds: number[]) =>
  pIds.every((p, i) =>
    Array.from({ length: REGIONS }, (_, r) => blockOf(pmem, r, p).equals(blockOf(dmem, r, dIds[i]))).every(Boolean),
  );

describe('push on loopback', () => {
  it('registration first (case A): the prefill WRITEs our blocks and the decode proves every WRITE came', async () => {
    const got = receiver.receive(params(), { requestId: 'cmpl-a-0a1b2c3d', localBlockIds: [5, 6, 7] });
    await new Promise((r) => setTimeout(r, 50));
    expect(sender.pending.registrations).toBe(1);
    const sent = await sender.offer('cmpl-a-0a1b2c3d', [1, 2, 3]);
    const r = await got;
    expect(sent).toMatchObject({ reason: 'written', decodeRequestId: 'cmpl-a-0a1b2c3d', writes: 1 });
    expect(sent.bytes).toBe(3 * REGIONS * BLOCK);
    expect(r).toMatchObject({ requestId: 'cmpl-a-0a1b2c3d', notifications: 1, writers: ['push-p'] });
    expect(sameBlocks([1, 2, 3], [5, 6, 7])).toBe(true);
    expect(blockOf(dmem, 0, 4).every((x) => x === 0)).toBe(true);
    expect(receiver.resources()).toMatchObject({ receiving: 0, quarantined: 0 });
    expect(sender.resources()).toMatchObject({ offers: 0, registrations: 0, xferHandles: 0 });
  });

  it('prefill first (case B), paired by base id across engine suffixes', async () => {
    const sent = sender.offer('cmpl-b-11111111', [8, 9]);
    const r = await receiver.receive(params(), { requestId: 'cmpl-b-22222222', localBlockIds: [[0, 1]] });
    expect(r.notifications).toBe(1);
    expect(await sent).toMatchObject({ reason: 'written', decodeRequestId: 'cmpl-b-22222222' });
    expect(sameBlocks([8, 9], [0, 1])).toBe(true);
  });

  it('a decode prefix hit registers fewer blocks: the prefill end-trims its own', async () => {
    const sent = sender.offer('trim', [1, 2, 3, 4]);
    await receiver.receive(params(), { requestId: 'trim', localBlockIds: [20, 21] });
    expect((await sent).bytes).toBe(2 * REGIONS * BLOCK);
    expect(sameBlocks([3, 4], [20, 21])).toBe(true);
  });

  it('two live requests with one base id pair with neither: never cross-written', async () => {
    const a = sender.offer('cmpl-x-aaaaaaaa', [1]);
    const b = sender.offer('cmpl-x-bbbbbbbb', [2]);
    const err = await receiver
      .receive(params(), { requestId: 'cmpl-x-cccccccc', localBlockIds: [3], timeoutMs: 300 })
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(PushError);
    expect(err).toMatchObject({ kind: 'timeout', code: 'NIXL_ERR_TIMEOUT' });
    expect(blockOf(dmem, 0, 3).every((x) => x === 0)).toBe(true);
    expect(sender.abort('cmpl-x-aaaaaaaa') && sender.abort('cmpl-x-bbbbbbbb')).toBe(true);
    expect((await a).reason).toBe('aborted');
    expect((await b).reason).toBe('aborted');
  });

  it('heartbeats naming an offered request extend its lease (vLLM: max(old, now + 2/3 lease)); unmatched ids do nothing', async () => {
    await sender.close();
    sender = new KvPushSender({ agent: pAgent, layout: rankLayout('P', pmem), leaseMs: 300, logger: quiet });
    dAgent.addRemoteAgent(pAgent.getAgentMetadata());
    const t0 = performance.now();
    const sent = sender.offer('hb-req', [1]);
    const end0 = sender.leaseEnd('hb-req')!;
    await new Promise((r) => setTimeout(r, 150));
    dAgent.sendNotif('push-p', 'HB:other,hb-req');
    await new Promise((r) => setTimeout(r, 20));
    expect(sender.stats.heartbeats).toBe(1);
    const end1 = sender.leaseEnd('hb-req')!;
    expect(end1).toBeGreaterThan(end0);
    expect(await sent).toMatchObject({ reason: 'expired', writes: 0 });
    // Held until the extended end, not the first one.
    expect(performance.now() - t0).toBeGreaterThanOrEqual(end1 - t0 - 1);
  });
});
