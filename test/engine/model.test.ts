// The model-based random test (test/model-harness.ts) in one process and
// across two. Seeded: FC_SEED=<n> replays a run; the seed is printed at the
// start and, with the shrunk sequence, on failure.
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import * as fs from 'node:fs';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DescList, type NixlAgent, engines } from '../../lib';
import {
  CANARY,
  NBUF,
  type Op,
  stats,
  type RemoteSide,
  SIZE,
  canaried,
  canariesIntact,
  fillPattern,
  type OracleEngine,
  oracleAgent,
  opArb,
  resources,
  runOracle,
} from '../model-harness';
import { Peer } from '../helpers';

setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc') as () => void;
const seed = process.env.FC_SEED ? Number(process.env.FC_SEED) : Math.floor(Math.random() * 2 ** 31);
console.log(`model test seed: ${seed} (FC_SEED=${seed} replays it)`);

let runs = 0;

class InProcess implements RemoteSide {
  readonly crossProcess = false;
  readonly agent: NixlAgent;
  readonly bufs = Array.from({ length: NBUF }, (_, j) => ({
    ...canaried(j === 0),
    reg: undefined as ReturnType<NixlAgent['registerMemory']> | undefined,
  }));
  readonly probe = canaried(true);
  readonly probeAddr: bigint;
  constructor(
    readonly name: string,
    engine: OracleEngine,
  ) {
    this.agent = oracleAgent(name, engine);
    this.agent.registerMemory(this.probe.data);
    this.probeAddr = DescList.from(this.probe.data).addr(0);
  }
  addr(j: number) {
    return DescList.from(this.bufs[j].data).addr(0);
  }
  async register(j: number) {
    this.bufs[j].reg = this.agent.registerMemory(this.bufs[j].data);
  }
  async deregister(j: number) {
    try {
      this.agent.deregisterMemory(this.bufs[j].reg!);
      this.bufs[j].reg = undefined;
      return 'ok';
    } catch (e) {
      return (e as { code: string }).code;
    }
  }
  async metadata() {
    return this.agent.getAgentMetadata();
  }
  async read(j: number, off: number, len: number) {
    return Buffer.from(this.bufs[j].data.subarray(off, off + len));
  }
  async canaries() {
    return this.bufs.every((b) => canariesIntact(b.whole)) && canariesIntact(this.probe.whole);
  }
  async fill(gen: number) {
    for (const [j, b] of this.bufs.entries()) fillPattern(b.data, 1, j, gen);
  }
  async scribble(j: number, gen: number) {
    fillPattern(this.bufs[j].data, 1, j, gen);
  }
  async close() {
    this.agent.close();
  }
}

class OtherProcess implements RemoteSide {
  readonly crossProcess = true;
  readonly peer: Peer;
  addrs: bigint[] = [];
  probeAddr = 0n;
  constructor(
    readonly name: string,
    engine: OracleEngine,
  ) {
    this.peer = new Peer('model-peer.js', [name, String(SIZE), String(CANARY), String(NBUF), engine]);
  }
  async init() {
    const r = await this.peer.request<{ addrs: bigint[]; probe: bigint }>({ cmd: 'hello' });
    this.addrs = r.addrs;
    this.probeAddr = r.probe;
    return this;
  }
  addr(j: number) {
    return this.addrs[j];
  }
  async register(j: number) {
    await this.peer.request({ cmd: 'register', j });
  }
  async deregister(j: number) {
    return (await this.peer.request<{ r: string }>({ cmd: 'deregister', j })).r;
  }
  async metadata() {
    return Buffer.from((await this.peer.request<{ md: Uint8Array }>({ cmd: 'metadata' })).md);
  }
  async read(j: number, off: number, len: number) {
    return Buffer.from((await this.peer.request<{ data: Uint8Array }>({ cmd: 'read', j, off, len })).data);
  }
  async canaries() {
    return (await this.peer.request<{ ok: boolean }>({ cmd: 'canaries' })).ok;
  }
  async fill(gen: number) {
    await this.peer.request({ cmd: 'fill', gen });
  }
  async scribble(j: number, gen: number) {
    await this.peer.request({ cmd: 'scribble', j, gen });
  }
  async close() {
    await this.peer.request({ cmd: 'close' });
    await this.peer.exit();
  }
}

function fdList(): string[] {
  return fs.readdirSync('/proc/self/fd').map((f) => {
    try {
      return `${f} -> ${fs.readlinkSync(`/proc/self/fd/${f}`)}`;
    } catch {
      return f;
    }
  });
}

// External buffers are freed by finalizers that run after the collection.
async function settleGc() {
  for (let i = 0; i < 5; i++) {
    gc();
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function check(ops: Op[], engine: OracleEngine, makeB: (name: string) => Promise<RemoteSide>) {
  const before = resources();
  const fdsBefore = fdList();
  // In a function of its own, so nothing of the run is still referenced here
  // when the garbage collector runs.
  await (async () => {
    const b = await makeB(`model-b-${runs}`);
    try {
      await runOracle(ops, b, String(runs++), engine);
    } finally {
      await b.close();
    }
  })();
  await settleGc();
  // Finalizers of external buffers run after the collection, in tasks of
  // their own, late on a loaded machine: a leak is what is still there after
  // 2 s of collections, not after the first few.
  let after = resources();
  for (let i = 0; i < 40 && (after.fds > before.fds || after.maps > before.maps); i++) {
    await settleGc();
    await new Promise((r) => setTimeout(r, 25));
    after = resources();
  }
  expect(after.threads, 'threads left behind').toBeLessThanOrEqual(before.threads);
  expect(
    after.fds,
    `fds left behind: ${fdList()
      .filter((f) => !fdsBefore.includes(f))
      .join(', ')}`,
  ).toBeLessThanOrEqual(before.fds);
  expect(after.maps, 'mappings left behind').toBeLessThanOrEqual(before.maps);
}

const wanted = (process.env.NIXL_NODE_ENGINE ? [process.env.NIXL_NODE_ENGINE] : ['loopback', 'nixl']) as OracleEngine[];

describe.each(wanted)('random Agent API sequences (fast-check, %s engine)', (engine) => {
  if (!engines.includes(engine)) {
    it.skip(`skipped: the ${engine} engine is not compiled in (build with NIXL_PREFIX=<nixl install>)`, () => {});
    return;
  }
  let first = 0;
  let before = { ...stats };
  beforeAll(() => {
    // Whatever an engine starts once per process (UCX's own threads), before
    // the first run counts what it leaves behind.
    oracleAgent('model-warmup', engine).close();
    first = runs;
    before = { ...stats };
  });
  afterAll(() => {
    const mine = Object.fromEntries(Object.entries(stats).map(([k, v]) => [k, v - before[k as keyof typeof stats]]));
    console.log(`model test (${engine}): ${runs - first} runs, ${JSON.stringify(mine)}`);
  });

  it('in one process', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(opArb, { minLength: 5, maxLength: 40, size: 'max' }), (ops) =>
        check(ops, engine, async (n) => new InProcess(n, engine)),
      ),
      {
        seed,
        numRuns: Number(process.env.FC_RUNS ?? 150),
        endOnFailure: !!process.env.FC_NO_SHRINK,
        ...(process.env.FC_PATH ? { path: process.env.FC_PATH } : {}),
      },
    );
  }, 300_000);

  it('across two processes', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(opArb, { minLength: 5, maxLength: 30, size: 'max' }), (ops) =>
        check(ops, engine, async (n) => new OtherProcess(n, engine).init()),
      ),
      { seed, numRuns: Number(process.env.FC_RUNS_MP ?? 20), endOnFailure: !!process.env.FC_NO_SHRINK },
    );
  }, 300_000);
});
