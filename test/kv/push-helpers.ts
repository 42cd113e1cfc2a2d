// Shared by the push tests: a prefill and a decode rank on the test's
// engine (ENGINE), each serving its side channel, with a KvPushSender and a
// KvPushReceiver over them.
import {
  DescList,
  KvPushReceiver,
  KvPushSender,
  NixlAgent,
  allocate,
  computeCompatibilityHash,
  servePrefill,
  type KvLayout,
} from '../../lib';
import type { KvPushReceiverOptions, KvPushSenderOptions } from '../../lib/kv';
import type { HandshakeServer } from '../../lib/handshake';

/** The engine the push tests run on: NIXL_NODE_ENGINE (docs/testing.md), else loopback. */
export const ENGINE = (process.env.NIXL_NODE_ENGINE as 'nixl' | 'loopback' | undefined) || 'loopback';

export const BLOCK = 4096;
export const BLOCKS = 32;
export const REGIONS = 2;
export const quiet = { warn() {} };
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

/** Waits until `f()` holds (polled every 5 ms), at most `ms`. */
export async function until(f: () => boolean, ms = 2000): Promise<void> {
  const t0 = performance.now();
  while (!f()) {
    if (performance.now() - t0 > ms) throw new Error('condition not reached');
    await new Promise((r) => setTimeout(r, 5));
  }
}

export function fill(mem: Buffer, seed: number): void {
  for (let i = 0; i < mem.length; i += 64) mem.writeUInt32LE((i * 2654435761 + seed) >>> 0, i);
}

/** A prefill rank P and a decode rank D, each with its agent, memory, side channel and push role. */
export class PushPair {
  pAgent!: NixlAgent;
  dAgent!: NixlAgent;
  pmem!: Buffer;
  dmem!: Buffer;
  pServer!: HandshakeServer;
  dServer!: HandshakeServer;
  sender!: KvPushSender;
  receiver!: KvPushReceiver;

  static async start(
    o: { sender?: Partial<KvPushSenderOptions>; receiver?: Partial<KvPushReceiverOptions>; tag?: string } = {},
  ): Promise<PushPair> {
    const t = new PushPair();
    const tag = o.tag ?? '';
    t.pAgent = new NixlAgent(`push-p${tag}`, { engine: ENGINE });
    t.dAgent = new NixlAgent(`push-d${tag}`, { engine: ENGINE });
    t.pmem = allocate(REGIONS * BLOCKS * BLOCK);
    t.dmem = allocate(REGIONS * BLOCKS * BLOCK);
    fill(t.pmem, 1);
    t.dmem.fill(0);
    t.pAgent.registerMemory(t.pmem);
    t.dAgent.registerMemory(t.dmem);
    const pLayout = rankLayout('P', t.pmem);
    const dLayout = rankLayout('D', t.dmem);
    t.pServer = await servePrefill({
      ranks: [{ agent: t.pAgent, layout: pLayout }],
      compatibilityHash: PUSH_HASH,
      port: 0,
    });
    t.dServer = await servePrefill({
      ranks: [{ agent: t.dAgent, layout: dLayout }],
      compatibilityHash: PUSH_HASH,
      port: 0,
    });
    t.sender = new KvPushSender({
      agent: t.pAgent,
      layout: pLayout,
      expectedHash: PUSH_HASH,
      leaseMs: 5000,
      logger: quiet,
      ...o.sender,
    });
    t.receiver = new KvPushReceiver({
      agent: t.dAgent,
      layout: dLayout,
      decodeHost: '127.0.0.1',
      decodePort: t.dServer.basePort,
      expectedHash: PUSH_HASH,
      kvLeaseMs: 5000,
      timeoutMs: 5000,
      ...o.receiver,
    });
    return t;
  }

  /** The kv_transfer_params a proxy gives the decode. */
  params(o: Record<string, unknown> = {}): Record<string, unknown> {
    return {
      do_remote_prefill: true,
      remote_engine_id: 'P',
      remote_request_id: 'router-1',
      remote_host: '127.0.0.1',
      remote_port: this.pServer.basePort,
      tp_size: 1,
      pp_size: 1,
      ...o,
    };
  }

  /** Whether our blocks dIds hold the prefill's pIds, every region. */
  same(pIds: number[], dIds: number[]): boolean {
    return pIds.every((p, i) =>
      Array.from({ length: REGIONS }, (_, r) => blockOf(this.pmem, r, p).equals(blockOf(this.dmem, r, dIds[i]))).every(
        Boolean,
      ),
    );
  }

  /** Whether the decode's memory is still all zero (nothing written). */
  untouched(): boolean {
    return this.dmem.every((x) => x === 0);
  }

  /** Closes everything (what a test already closed is skipped). */
  async close(): Promise<void> {
    for (const f of [
      () => this.receiver.close(),
      () => this.sender.close(),
      () => this.pServer.close(),
      () => this.dServer.close(),
      () => this.pAgent.close(),
      () => this.dAgent.close(),
    ])
      await Promise.resolve()
        .then(f)
        .catch(() => undefined);
  }
}
