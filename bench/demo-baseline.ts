// The demo's pulls in one process: the same prefill and decode ranks, the
// same blocks per region, the same requests (each round's local and remote
// block ids, read from the demo's own JSON), the same pulls in flight per
// decode rank, through KvPuller and PrefillTracker on the same engine. What
// the demo adds (one process per rank, IPC, its progress reports) is what a
// ratio of the two measures. Every block is checked after each round, apart
// from the timing.
import {
  DescList,
  KvPuller,
  type KvLayout,
  NixlAgent,
  PrefillTracker,
  allocate,
  servePrefill,
  targetRemoteRanks,
} from '../lib';
import type { Engine } from './agents';

/** The demo's geometry and requests, as `nixl-node demo --json` writes them. */
export interface DemoPlan {
  geometry: {
    prefillTp: number;
    decodeTp: number;
    regions: number;
    blocks: number;
    heads: number;
    mla: boolean;
    prefillBlockBytes: number;
    decodeBlockBytes: number;
    inFlight: number;
  };
  method: 'zmq' | 'http';
  /** Which agents run NIXL's progress thread, as in the demo. */
  progressThread: 'prefill' | 'both' | 'none';
  plan: Array<Array<{ requestId: string; local: number[]; remote: number[] }>>;
}

/** One round of the baseline, over every decode rank. */
export interface BaselineRound {
  round: number;
  wallMs: number;
  bytes: number;
  gbps: number;
  /** CPU time of this process over the round (every rank, prefill included) / wall time. */
  cores: number;
  gbPerCpuS: number;
  descriptors: number;
}

interface Rank {
  agent: NixlAgent;
  mem: Buffer;
  layout: KvLayout;
}

function layout(engineId: string, tpSize: number, tpRank: number, p: DemoPlan, blockLen: number, mem: Buffer) {
  const g = p.geometry;
  const base = DescList.from(mem).addr(0);
  const regionBytes = blockLen * g.blocks;
  return {
    engineId,
    tpSize,
    tpRank,
    numBlocks: g.blocks,
    blockSize: 16,
    blockLens: Array<number>(g.regions).fill(blockLen),
    baseAddrs: Array.from({ length: g.regions }, (_, i) => base + BigInt(i * regionBytes)),
    kvCacheLayout: 'HND' as const,
    isMla: g.mla,
    totalNumKvHeads: g.heads,
  };
}

// A byte per (prefill rank, region, block): a decode rank's slice of a block
// holds it whole, so a check knows the block came from the right place.
const mark = (rank: number, region: number, block: number) => (rank * 89 + region * 131 + block * 31 + 1) & 0xff;

function rankAgent(name: string, engine: Engine, progressThread: boolean): NixlAgent {
  // As the demo's workers make theirs.
  return new NixlAgent(`${name}-${process.pid}`, { engine, progressThread });
}

/** The demo's prefill and decode ranks in this process, handshaken; run() runs its plan once. */
export class DemoBaseline {
  readonly #p: DemoPlan;
  readonly #prefill: Rank[] = [];
  readonly #decode: Rank[] = [];
  readonly #trackers: PrefillTracker[] = [];
  readonly #pullers: KvPuller[] = [];
  #server: Awaited<ReturnType<typeof servePrefill>> | undefined;
  #port = 0;
  #runs = 0;
  readonly #wantBlock = new Map<number, Buffer>();

  private constructor(p: DemoPlan) {
    this.#p = p;
  }

  static async open(p: DemoPlan, engine: Engine): Promise<DemoBaseline> {
    const g = p.geometry;
    if (g.mla || g.decodeTp % g.prefillTp !== 0)
      throw new Error('the demo baseline runs decode TP a multiple of prefill TP, without MLA');
    const b = new DemoBaseline(p);
    try {
      await b.#open(engine);
    } catch (e) {
      await b.close();
      throw e;
    }
    return b;
  }

  async #open(engine: Engine): Promise<void> {
    const g = this.#p.geometry;
    for (let r = 0; r < g.prefillTp; r++) {
      const agent = rankAgent(`demo-baseline-prefill-tp${r}`, engine, this.#p.progressThread !== 'none');
      const mem = allocate(g.prefillBlockBytes * g.blocks * g.regions);
      for (let region = 0; region < g.regions; region++)
        for (let block = 0; block < g.blocks; block++) {
          const off = (region * g.blocks + block) * g.prefillBlockBytes;
          mem.fill(mark(r, region, block), off, off + g.prefillBlockBytes);
        }
      agent.registerMemory(mem);
      this.#prefill.push({
        agent,
        mem,
        layout: layout('demo-baseline-prefill', g.prefillTp, r, this.#p, g.prefillBlockBytes, mem),
      });
      this.#trackers.push(new PrefillTracker({ agent, tpSize: g.prefillTp, expireMs: 120_000 }));
    }
    this.#server = await servePrefill({
      ranks: this.#prefill.map(({ agent, layout }) => ({ agent, layout })),
      compatibilityHash: 'demo-baseline',
      port: 0,
      handshake: this.#p.method,
      logger: { warn() {} },
    });
    this.#port = this.#server.basePort;
    for (let r = 0; r < g.decodeTp; r++) {
      const agent = rankAgent(`demo-baseline-decode-tp${r}`, engine, this.#p.progressThread === 'both');
      const mem = allocate(g.decodeBlockBytes * g.blocks * g.regions);
      agent.registerMemory(mem);
      const l = layout('demo-baseline-decode', g.decodeTp, r, this.#p, g.decodeBlockBytes, mem);
      this.#decode.push({ agent, mem, layout: l });
      const puller = new KvPuller({
        agent,
        layout: l,
        handshake: this.#p.method,
        expectedHash: 'demo-baseline',
        maxConcurrent: g.inFlight,
      });
      this.#pullers.push(puller);
      await puller.connect(this.#remote());
    }
  }

  #remote() {
    return { host: '127.0.0.1', port: this.#port, tpSize: this.#p.geometry.prefillTp };
  }

  /** Runs every round of the plan once; throws if a block is wrong or a request was not freed by its reads. */
  async run(): Promise<BaselineRound[]> {
    const run = this.#runs++;
    const out: BaselineRound[] = [];
    for (const [round, requests] of this.#p.plan.entries()) {
      // As the demo's decode ranks: pages in place and cleared before each round.
      for (const d of this.#decode) d.mem.fill(0);
      const ids = requests.map((q) => `${q.requestId}-baseline${run}`);
      const released = requests.flatMap((q, i) => this.#trackers.map((t) => t.expect(ids[i], q.remote)));
      let bytes = 0;
      let descriptors = 0;
      const cpu0 = process.cpuUsage();
      const t0 = performance.now();
      await Promise.all(
        this.#pullers.map((puller) =>
          Promise.all(
            requests.map(async (q, i) => {
              const r = await puller.pullBlocks({
                remote: this.#remote(),
                localBlockIds: q.local,
                remoteBlockIds: q.remote,
                requestId: ids[i],
                timeoutMs: 60_000,
              });
              bytes += r.bytes;
              descriptors += r.descriptors;
            }),
          ),
        ),
      );
      const wallMs = performance.now() - t0;
      const cpu = process.cpuUsage(cpu0);
      const cpuMs = (cpu.user + cpu.system) / 1000;
      const reasons = await Promise.all(released);
      const notRead = reasons.filter((x) => x.reason !== 'read').length;
      if (notRead) throw new Error(`demo baseline: ${notRead} prefill holds ended without their reads`);
      const bad = this.#check(requests);
      if (bad) throw new Error(`demo baseline: ${bad} block slices WRONG after round ${round + 1}`);
      out.push({
        round,
        wallMs,
        bytes,
        gbps: bytes / (wallMs * 1e6),
        cores: cpuMs / wallMs,
        gbPerCpuS: bytes / (cpuMs * 1e6),
        descriptors,
      });
    }
    return out;
  }

  /** Block slices that do not hold their remote block's mark. */
  #check(requests: DemoPlan['plan'][number]): number {
    const g = this.#p.geometry;
    const len = g.decodeBlockBytes;
    let bad = 0;
    for (const [r, d] of this.#decode.entries()) {
      const [remoteRank] = targetRemoteRanks(g.decodeTp, r, g.prefillTp);
      for (const q of requests)
        for (let region = 0; region < g.regions; region++)
          for (const [k, local] of q.local.entries()) {
            const off = (region * g.blocks + local) * len;
            if (!d.mem.subarray(off, off + len).equals(this.#want(mark(remoteRank, region, q.remote[k])))) bad++;
          }
    }
    return bad;
  }

  #want(byte: number): Buffer {
    let b = this.#wantBlock.get(byte);
    if (!b) {
      b = Buffer.alloc(this.#p.geometry.decodeBlockBytes, byte);
      this.#wantBlock.set(byte, b);
    }
    return b;
  }

  async close(): Promise<void> {
    for (const p of this.#pullers) await p.close();
    await this.#server?.close();
    for (const t of this.#trackers) await t.close();
    for (const r of [...this.#decode, ...this.#prefill]) r.agent.close();
  }
}
