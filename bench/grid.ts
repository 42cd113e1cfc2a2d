// A grid in nixlbench's shape: READ and WRITE over block sizes x batch sizes
// (descriptors per request) between two processes, with GB/s and the avg and
// p99 of prep (making the request), post (the post call) and transfer (post
// to completion) in microseconds, as nixlbench prints them. Its defaults are
// nixlbench's (benchmark/nixlbench/src/utils/utils.cpp: blocks 4 KiB to 64 MiB
// doubling, batch from 1 doubling, 1000 iterations and 100 warm-up, blocks
// over 1 MiB run 1/16 of them). nixlbench's max_batch_size defaults to 1; the
// grid goes up to 64 descriptors so that it is a grid. The first transfer of
// a fresh agent pair (connection set-up included: UCX connects lazily) is
// reported apart from the warm rows.
import { fork } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { DescList, type NixlAgent, allocate } from '../lib';
import { benchAgent, type Engine } from './agents';
import { median, nowNs, percentile } from './stats';

export interface Dist {
  avg: number;
  p99: number;
}

export interface GridRow {
  engine: string;
  op: 'READ' | 'WRITE';
  blockBytes: number;
  batch: number;
  iterations: number;
  gbps: number;
  prepUs: Dist;
  postUs: Dist;
  xferUs: Dist;
  /** The median iteration, post to completion (gbps is over their sum: one preemption moves it, not this). */
  medianUs: number;
  /** With NIXL: the native program's figures for the same cell, and gbps / native gbps. */
  native?: { gbps: number; prepUs: Dist; postUs: Dist; xferUs: Dist; medianUs: number };
  ratio?: number;
  /** native medianUs / medianUs: the same ratio for the median iteration. */
  ratioMedian?: number;
}

/** The first transfer of a fresh agent pair, and the warm average of the same cell. */
export interface GridCold {
  engine: string;
  op: 'READ' | 'WRITE';
  blockBytes: number;
  batch: number;
  /** Loading the peer's metadata (addRemoteAgent). */
  connectUs: number;
  prepUs: number;
  postUs: number;
  xferUs: number;
  warmXferUs: number;
}

export interface GridOptions {
  startBlock: number;
  maxBlock: number;
  /** Block size factor from one row to the next (nixlbench: 2). */
  blockStep: number;
  startBatch: number;
  maxBatch: number;
  batchStep: number;
  numIter: number;
  warmupIter: number;
  /** Blocks over 1 MiB run numIter / this (nixlbench's large_blk_iter_ftr). */
  largeBlockIterFactor: number;
  /** Cells larger than this (block x batch) are skipped: both sides hold this much. */
  maxRequestBytes: number;
}

export const NIXLBENCH_DEFAULTS: GridOptions = {
  startBlock: 4 << 10,
  maxBlock: 64 << 20,
  blockStep: 2,
  startBatch: 1,
  maxBatch: 64,
  batchStep: 2,
  numIter: 1000,
  warmupIter: 100,
  largeBlockIterFactor: 16,
  maxRequestBytes: 64 << 20,
};

/** --quick: the same span of sizes in steps of 4, a tenth of the iterations. */
export const QUICK: GridOptions = {
  ...NIXLBENCH_DEFAULTS,
  blockStep: 4,
  batchStep: 4,
  numIter: 100,
  warmupIter: 10,
};

export function gridCells(o: GridOptions): Array<{ blockBytes: number; batch: number; iterations: number }> {
  const cells = [];
  for (let block = o.startBlock; block <= o.maxBlock; block *= o.blockStep) {
    for (let batch = o.startBatch; batch <= o.maxBatch; batch *= o.batchStep) {
      if (block * batch > o.maxRequestBytes) break;
      const iterations = Math.max(1, block > 1 << 20 ? Math.floor(o.numIter / o.largeBlockIterFactor) : o.numIter);
      cells.push({ blockBytes: block, batch, iterations });
    }
  }
  return cells;
}

function dist(xs: number[]): Dist {
  return { avg: xs.reduce((a, x) => a + x, 0) / xs.length, p99: percentile(xs, 99) };
}

const us = (t0: bigint, t1: bigint) => Number(t1 - t0) / 1000;

/** A peer agent in a child process (bench/peer.ts) with `bytes` of registered memory, connected both ways. */
export interface Peer {
  name: string;
  addr: bigint;
  /** How long addRemoteAgent took for its metadata. */
  connectUs: number;
  close(): Promise<void>;
}

export async function startPeer(local: NixlAgent, bytes: number): Promise<Peer> {
  const child = fork(path.join(__dirname, 'peer.js'), [], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    serialization: 'advanced',
    env: { ...process.env, NIXL_NODE_ENGINE: local.engine },
  });
  // The loopback engine maps memory from allocate() (its fast path); NIXL gets plain memory, as nixlbench's.
  child.send({ cmd: 'init', bytes, shared: local.engine === 'loopback' });
  const [init] = (await once(child, 'message')) as [{ md: Uint8Array; addr: bigint }];
  const t0 = nowNs();
  const name = local.addRemoteAgent(Buffer.from(init.md));
  const connectUs = us(t0, nowNs());
  child.send({ cmd: 'load', md: local.getAgentMetadata() });
  await once(child, 'message');
  return {
    name,
    addr: init.addr,
    connectUs,
    close: async () => {
      child.send({ cmd: 'exit' });
      await once(child, 'exit');
      local.removeRemoteAgent(name);
    },
  };
}

function descs(base: bigint, block: number, batch: number): DescList {
  const t = new BigUint64Array(batch * 3);
  for (let j = 0; j < batch; j++) {
    t[3 * j] = base + BigInt(j * block);
    t[3 * j + 1] = BigInt(block);
  }
  return new DescList(t);
}

/** One cell: prep sampled over `iterations` fresh requests, then one request posted warm-up + iterations times. */
async function runCell(
  agent: NixlAgent,
  peer: Peer,
  base: bigint,
  op: 'READ' | 'WRITE',
  cell: { blockBytes: number; batch: number; iterations: number },
  warmupIter: number,
): Promise<Omit<GridRow, 'engine'>> {
  const l = descs(base, cell.blockBytes, cell.batch);
  const r = descs(peer.addr, cell.blockBytes, cell.batch);
  const prep: number[] = [];
  for (let i = 0; i < cell.iterations; i++) {
    const t0 = nowNs();
    const h = agent.initializeXfer(op, l, r, peer.name);
    prep.push(us(t0, nowNs()));
    agent.releaseXferHandle(h);
  }
  const h = agent.initializeXfer(op, l, r, peer.name);
  const post: number[] = [];
  const xfer: number[] = [];
  const iterUs: number[] = [];
  let total = 0n;
  try {
    for (let i = -warmupIter; i < cell.iterations; i++) {
      // As the native program (and nixlbench) check the state after posting:
      // a transfer that finished inside its post has nothing to wait for.
      const t0 = nowNs();
      const state = agent.transfer(h);
      const t1 = nowNs();
      if (state !== 'DONE') await agent.wait(h);
      const t2 = nowNs();
      if (i < 0) continue;
      post.push(us(t0, t1));
      xfer.push(us(t1, t2));
      iterUs.push(us(t0, t2));
      total += t2 - t0;
    }
  } finally {
    agent.releaseXferHandle(h);
  }
  const bytes = cell.blockBytes * cell.batch * cell.iterations;
  return {
    op,
    ...cell,
    gbps: bytes / Number(total),
    prepUs: dist(prep),
    postUs: dist(post),
    xferUs: dist(xfer),
    medianUs: median(iterUs),
  };
}

/** The first transfer of a fresh agent pair: prep, post and transfer of one request of the first cell. */
async function coldTransfer(
  agent: NixlAgent,
  peer: Peer,
  base: bigint,
  op: 'READ' | 'WRITE',
  cell: { blockBytes: number; batch: number },
): Promise<Omit<GridCold, 'engine' | 'warmXferUs'>> {
  const t0 = nowNs();
  const h = agent.initializeXfer(
    op,
    descs(base, cell.blockBytes, cell.batch),
    descs(peer.addr, cell.blockBytes, cell.batch),
    peer.name,
  );
  const t1 = nowNs();
  agent.transfer(h);
  const t2 = nowNs();
  await agent.wait(h);
  const t3 = nowNs();
  agent.releaseXferHandle(h);
  return {
    op,
    blockBytes: cell.blockBytes,
    batch: cell.batch,
    connectUs: peer.connectUs,
    prepUs: us(t0, t1),
    postUs: us(t1, t2),
    xferUs: us(t2, t3),
  };
}

/**
 * The grid on one engine. `native`, when given, runs the same cell in the
 * native program right after the binding's (NIXL only), for the ratio.
 */
export async function benchGrid(
  engine: Engine,
  o: GridOptions,
  native?: (
    op: 'READ' | 'WRITE',
    cell: { blockBytes: number; batch: number; iterations: number },
  ) => Promise<GridRow['native']>,
): Promise<{ rows: GridRow[]; cold: GridCold[] }> {
  const cells = gridCells(o);
  if (cells.length === 0) throw new RangeError('the grid is empty: check the block and batch bounds');
  const poolBytes = Math.max(...cells.map((c) => c.blockBytes * c.batch));
  const rows: GridRow[] = [];
  const cold: GridCold[] = [];
  for (const op of ['READ', 'WRITE'] as const) {
    // A fresh agent pair per op, so each op has its own first transfer.
    const agent = benchAgent(`bench-grid-${op.toLowerCase()}`, engine);
    // NIXL gets plain heap memory, as the native program's std::vector and
    // nixlbench's: over UCX's cma a WRITE from allocate()'s shared mapping
    // ran at about half the speed of one from the heap, which measured the
    // memory, not the binding. The loopback engine's fast path is allocate().
    const mem = engine === 'nixl' ? Buffer.alloc(poolBytes) : allocate(poolBytes);
    mem.fill(1);
    agent.registerMemory(mem);
    const base = DescList.from(mem).addr(0);
    const peer = await startPeer(agent, poolBytes);
    try {
      const first = await coldTransfer(agent, peer, base, op, cells[0]);
      for (const cell of cells) {
        const row: GridRow = { engine: agent.engine, ...(await runCell(agent, peer, base, op, cell, o.warmupIter)) };
        if (native) {
          row.native = await native(op, cell);
          if (row.native) {
            row.ratio = row.gbps / row.native.gbps;
            row.ratioMedian = row.native.medianUs / row.medianUs;
          }
        }
        rows.push(row);
      }
      cold.push({ engine: agent.engine, ...first, warmXferUs: rows.find((r) => r.op === op)!.xferUs.avg });
    } finally {
      await peer.close();
      agent.close();
    }
  }
  return { rows, cold };
}
