// Descriptors per request and coalescing: KvPuller pulls of 16 KiB blocks in
// one process, per-block descriptors vs runs merged into larger ones, each
// as a ratio to memcpy measured in the same run.
import { DescList, KvPuller, allocate, servePrefill, type KvLayout } from '../lib';
import { benchAgent, type Engine } from './agents';
import { memcpyBaseline } from './loopback';
import { median, nowNs } from './stats';

const BLOCK = 16 << 10;
const REGIONS = 8;
const BLOCKS = 1024;

export interface CoalesceRow {
  blocksPerRequest: number;
  descriptorsPlain: number;
  descriptorsCoalesced: number;
  plainGbps: number;
  coalescedGbps: number;
  memcpyGbps: number;
  plainRatio: number;
  coalescedRatio: number;
  gain: number;
}

function layout(engineId: string, mem: Buffer): KvLayout {
  const base = DescList.from(mem).addr(0);
  return {
    engineId,
    tpSize: 1,
    tpRank: 0,
    numBlocks: BLOCKS,
    blockSize: 16,
    blockLens: Array(REGIONS).fill(BLOCK),
    baseAddrs: Array.from({ length: REGIONS }, (_, i) => base + BigInt(i * BLOCK * BLOCKS)),
    kvCacheLayout: 'HND',
    totalNumKvHeads: 8,
  };
}

export async function benchCoalesce(engine: Engine, reps = 5, sizes = [1, 4, 16, 64, 256]): Promise<CoalesceRow[]> {
  const p = benchAgent('coal-p', engine);
  const d = benchAgent('coal-d', engine);
  const pm = allocate(REGIONS * BLOCKS * BLOCK);
  const dm = allocate(REGIONS * BLOCKS * BLOCK);
  pm.fill(3);
  dm.fill(4);
  p.registerMemory(pm);
  d.registerMemory(dm);
  const server = await servePrefill({
    ranks: [{ agent: p, layout: layout('P', pm) }],
    compatibilityHash: 'b',
    port: 0,
    logger: { warn() {} },
  });
  const puller = new KvPuller({ agent: d, layout: layout('D', dm), expectedHash: 'b' });
  const remote = { host: '127.0.0.1', port: server.basePort, tpSize: 1 };
  await puller.connect(remote);
  const rows: CoalesceRow[] = [];
  try {
    for (const n of sizes) {
      const requests = Math.max(4, Math.floor(BLOCKS / n / 2));
      const run = async (coalesce: boolean) => {
        const xs: number[] = [];
        let descs = 0;
        for (let rep = 0; rep < reps; rep++) {
          const t = nowNs();
          let bytes = 0;
          for (let q = 0; q < requests; q++) {
            // adjacent blocks, as a prefill engine allocates a prompt's blocks
            const start = (q * n) % (BLOCKS - n);
            const ids = Array.from({ length: n }, (_, i) => start + i);
            const r = await puller.pullBlocks({
              remote,
              localBlockIds: ids,
              remoteBlockIds: ids,
              requestId: `q${q}`,
              coalesce,
            });
            bytes += r.bytes;
            descs = r.descriptors;
          }
          xs.push(bytes / Number(nowNs() - t));
        }
        return { gbps: median(xs), descs };
      };
      await run(false); // warm: page faults, caches
      const plain = await run(false);
      const merged = await run(true);
      const memcpy = memcpyBaseline(5);
      rows.push({
        blocksPerRequest: n,
        descriptorsPlain: plain.descs,
        descriptorsCoalesced: merged.descs,
        plainGbps: plain.gbps,
        coalescedGbps: merged.gbps,
        memcpyGbps: memcpy,
        plainRatio: plain.gbps / memcpy,
        coalescedRatio: merged.gbps / memcpy,
        gain: merged.gbps / plain.gbps,
      });
    }
  } finally {
    await puller.close();
    await server.close();
    p.close();
    d.close();
  }
  return rows;
}
