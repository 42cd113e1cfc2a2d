// The binding against a native program on the same NIXL (bench/native/
// nixl_read.cpp, built here only when an installed NIXL is found): the same
// prepped READ of 64 MiB between two processes, per block size, with
// contiguous block ids (NIXL merges them into few descriptors) and with
// every other remote block (nothing merges: one descriptor per block). The
// two alternate round by round, so both see the machine in the same state.
import { fork, spawn } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { createInterface } from 'node:readline';
import { DescList } from '../lib';
import { nativeProgram } from '../lib/native-program';
import { benchAgent } from './agents';
import { median, nowNs } from './stats';

const POOL = 64 << 20;
export const NATIVE_BLOCKS = [16 << 10, 64 << 10, 256 << 10, 1 << 20];

export interface NativeRow {
  blockBytes: number;
  layout: 'contiguous' | 'scattered';
  descriptors: number;
  nativeGbps: number;
  nativeRange: [number, number];
  bindingGbps: number;
  bindingRange: [number, number];
  /** Median over rounds of (binding median / native median) within a round. */
  ratio: number;
  ratioRange: [number, number];
  /** Native postXferReq call (it runs the copy on one host), per descriptor, us. */
  nativePostUsPerDesc: number;
  /** The binding's transfer() call, us (it only queues). */
  bindingPostUs: number;
}

interface NativeJob {
  gbps: number;
  gbpsMin: number;
  gbpsMax: number;
  postUs: number;
}

/**
 * The native program in --serve mode: one process pair, its memory
 * registered once, one job per line. Alternating its jobs with the binding's
 * repetitions compares the two at the same moment on the same kind of memory;
 * separate runs minutes apart differed by 2x on this shared machine.
 */
async function startNative(bin: string, pool: number) {
  const child = spawn(bin, ['--serve', String(pool)], { stdio: ['pipe', 'pipe', 'inherit'], env: process.env });
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  const next = async () => {
    const { value, done } = await lines.next();
    if (done) throw new Error(`the native program exited (${child.exitCode ?? child.signalCode})`);
    const j = JSON.parse(value);
    if (j.error) throw new Error(`the native program: ${j.error}`);
    return j;
  };
  await next(); // {"ready":true}
  return {
    /** One job line, its JSON answer. */
    async ask(line: string): Promise<Record<string, unknown>> {
      child.stdin.write(`${line}\n`);
      return next();
    },
    async run(block: number, count: number, reps: number, scatter: boolean): Promise<NativeJob> {
      child.stdin.write(`${block} ${count} ${reps} ${scatter ? 1 : 0} 0\n`);
      return next();
    },
    async close() {
      child.stdin.end();
      if (child.exitCode === null) await once(child, 'exit');
      if (child.exitCode !== 0) throw new Error(`the native program exited with ${child.exitCode}`);
    },
  };
}

/**
 * rounds x reps: each round times `reps` binding READs, then the native
 * program's `reps`; the ratio is the median of the rounds' ratios.
 */
export async function benchNative(rounds: number, reps: number): Promise<NativeRow[] | { skip: string }> {
  const prog = nativeProgram();
  if ('skip' in prog) return prog;
  const local = benchAgent('bench-native-local', 'nixl');
  // After benchAgent: it sets UCX_TLS (sm,self unless set), which the native
  // program must see too, or the two run different UCX transports.
  const native = await startNative(prog.path, POOL);
  // Plain (anonymous) memory on both sides, as the native program's std::vector.
  const mem = Buffer.alloc(POOL);
  local.registerMemory(mem);
  const base = DescList.from(mem).addr(0);
  const child = fork(path.join(__dirname, 'peer.js'), [], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    serialization: 'advanced',
    env: { ...process.env, NIXL_NODE_ENGINE: 'nixl' },
  });
  const rows: NativeRow[] = [];
  try {
    child.send({ cmd: 'init', bytes: 2 * POOL, shared: false });
    const [init] = (await once(child, 'message')) as [{ md: Uint8Array; addr: bigint }];
    const remoteName = local.addRemoteAgent(Buffer.from(init.md));
    child.send({ cmd: 'load', md: local.getAgentMetadata() });
    await once(child, 'message');
    for (const block of NATIVE_BLOCKS) {
      for (const layout of ['contiguous', 'scattered'] as const) {
        const n = POOL / block;
        const remoteBlocks = layout === 'scattered' ? 2 * n : n;
        const l = new BigUint64Array(n * 3);
        const r = new BigUint64Array(remoteBlocks * 3);
        for (let i = 0; i < n; i++) {
          l[3 * i] = base + BigInt(i * block);
          l[3 * i + 1] = BigInt(block);
        }
        for (let j = 0; j < remoteBlocks; j++) {
          r[3 * j] = init.addr + BigInt(j * block);
          r[3 * j + 1] = BigInt(block);
        }
        const ld = local.prepXferDlist('', new DescList(l));
        const rd = local.prepXferDlist(remoteName, new DescList(r));
        const li = Uint32Array.from({ length: n }, (_, i) => i);
        const ri = Uint32Array.from({ length: n }, (_, i) => (layout === 'scattered' ? 2 * i : i));
        const h = local.makePreppedXfer('READ', ld, li, rd, ri);
        local.transfer(h);
        await local.wait(h); // warm-up
        const xs: number[] = [];
        const posts: number[] = [];
        const nat: NativeJob[] = [];
        const ratios: number[] = [];
        for (let round = 0; round < rounds; round++) {
          const mine: number[] = [];
          for (let i = 0; i < reps; i++) {
            const t = nowNs();
            local.transfer(h);
            posts.push(Number(nowNs() - t) / 1000);
            await local.wait(h);
            mine.push(POOL / Number(nowNs() - t));
          }
          xs.push(...mine);
          const job = await native.run(block, n, reps, layout === 'scattered');
          nat.push(job);
          ratios.push(median(mine) / job.gbps);
        }
        local.releaseXferHandle(h);
        local.releaseDlistHandle(ld);
        local.releaseDlistHandle(rd);
        rows.push({
          blockBytes: block,
          layout,
          descriptors: n,
          nativeGbps: median(nat.map((j) => j.gbps)),
          nativeRange: [Math.min(...nat.map((j) => j.gbpsMin)), Math.max(...nat.map((j) => j.gbpsMax))],
          bindingGbps: median(xs),
          bindingRange: [Math.min(...xs), Math.max(...xs)],
          ratio: median(ratios),
          ratioRange: [Math.min(...ratios), Math.max(...ratios)],
          nativePostUsPerDesc: median(nat.map((j) => j.postUs)) / n,
          bindingPostUs: median(posts),
        });
      }
    }
  } finally {
    child.send({ cmd: 'exit' });
    await once(child, 'exit');
    local.close();
    await native.close();
  }
  return rows;
}

type Dist = { avg: number; p99: number };
/** medianUs: the median iteration, post to completion. */
export type NativeGridCell = { gbps: number; prepUs: Dist; postUs: Dist; xferUs: Dist; medianUs: number };

/**
 * The native program serving grid cells (bench/grid.ts), one process pair
 * holding `pool` bytes; or why it cannot run.
 */
export async function nativeGrid(pool: number): Promise<
  | {
      run(op: 'READ' | 'WRITE', block: number, batch: number, iters: number, warmup: number): Promise<NativeGridCell>;
      close(): Promise<void>;
    }
  | { skip: string }
> {
  const prog = nativeProgram();
  if ('skip' in prog) return prog;
  process.env.UCX_TLS ??= 'sm,self'; // as benchAgent sets it for the binding's agents
  const native = await startNative(prog.path, pool);
  return {
    async run(op, block, batch, iters, warmup) {
      const j = await native.ask(`grid ${op} ${block} ${batch} ${iters} ${warmup}`);
      return {
        gbps: j.gbps as number,
        prepUs: j.prepUs as Dist,
        postUs: j.postUs as Dist,
        xferUs: j.xferUs as Dist,
        medianUs: j.medianUs as number,
      };
    },
    close: () => native.close(),
  };
}
