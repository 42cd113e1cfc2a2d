// The demo against the bench, for the same blocks: `nixl-node demo` run as a
// user runs it (a child process, through the command, --json), and in this
// process the same pulls through KvPuller (demo-baseline.ts), alternating run
// by run. Each run of either side is the demo's rounds: round 1 reads the
// prefill's pages for the first time, later rounds read them again, so the
// row compares later rounds and reports round 1 apart.
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { promisify } from 'node:util';
import type { Engine } from './agents';
import { type BaselineRound, DemoBaseline, type DemoPlan } from './demo-baseline';
import { memcpyBaseline } from './loopback';
import { median } from './stats';

const execFileP = promisify(execFile);

/** The demo's default job, passed to it option by option so that a change of its defaults cannot move the row. */
export const DEMO_ROW = {
  prefillTp: 2,
  decodeTp: 4,
  layers: 32,
  blocks: 256,
  blockKib: 64,
  heads: 8,
  requests: 16,
  inFlight: 4,
  rounds: 3,
} as const;

export type DemoRowGeometry = { [K in keyof typeof DEMO_ROW]: number };

/** What the row reads of the demo's JSON (demo/result.ts writes it). */
interface DemoJson extends DemoPlan {
  ok: boolean;
  failures: string[];
  engine: string;
  geometry: DemoPlan['geometry'] & { layers: number; blockKib: number; requests: number; rounds: number };
  memcpyGbps: number;
  rounds: Array<{ round: number; gbps: number; cores: number; gbPerCpuS: number; wallMs: number }>;
  native?: { gbps: number; gbpsMin: number; gbpsMax: number } | { skip: string } | { error: string };
}

/** One side of one run: GB/s of round 1 and of each later round, and the CPU they took. */
export interface DemoSide {
  firstGbps: number;
  laterGbps: number[];
  /** Median over the later rounds. */
  gbps: number;
  gbPerCpuS: number;
  cores: number;
}

export interface DemoRun {
  engine: string;
  run: number;
  /** Which side ran first in this run (they alternate). */
  first: 'demo' | 'baseline';
  demo: DemoSide;
  baseline: DemoSide;
  /** demo.gbps / baseline.gbps. */
  ratio: number;
  /** demo.gbPerCpuS / baseline.gbPerCpuS: the work a byte costs, whatever CPU each side got. */
  cpuRatio: number;
  /** The demo's own memcpy line (one thread, 64 MiB). */
  demoMemcpyGbps: number;
  /** With NIXL: the demo's line for the C++ program on the same NIXL. */
  nativeGbps?: number;
}

export interface DemoRow {
  engine: string;
  geometry: DemoRowGeometry;
  runs: number;
  /** Later rounds of every run: median and range, GB/s. */
  demoGbps: number;
  demoRange: [number, number];
  baselineGbps: number;
  baselineRange: [number, number];
  /** Per run, demo / baseline (medians of its later rounds): median and range. */
  ratio: number;
  ratioRange: [number, number];
  /** Round 1 (first touch of the prefill's pages), median over runs. */
  demoFirstGbps: number;
  baselineFirstGbps: number;
  /** Bytes per CPU second, later rounds (the demo: its decode ranks; the baseline: this whole process). */
  demoGbPerCpuS: number;
  baselineGbPerCpuS: number;
  /** Per run, demo / baseline bytes per CPU second: median and range. On a shared machine the wall-time ratio
   * says as much about the CPU each side was given as about the work; this one holds still. */
  cpuRatio: number;
  cpuRatioRange: [number, number];
  /** memcpy of this process, one thread, 64 MiB, measured between the runs. */
  memcpyGbps: number;
  /** With NIXL: the demo's line for the C++ program on the same NIXL, median over runs. */
  nativeGbps?: number;
}

function side(rounds: Array<{ gbps: number; gbPerCpuS: number; cores: number }>): DemoSide {
  const later = rounds.slice(1);
  const use = later.length ? later : rounds;
  return {
    firstGbps: rounds[0].gbps,
    laterGbps: later.map((r) => r.gbps),
    gbps: median(use.map((r) => r.gbps)),
    gbPerCpuS: median(use.map((r) => r.gbPerCpuS)),
    cores: median(use.map((r) => r.cores)),
  };
}

function cliPath(): string {
  // dist/bench/demo.js -> dist/cli/nixl-node.js: the command as installed.
  return path.join(__dirname, '..', 'cli', 'nixl-node.js');
}

/** Runs `nixl-node demo` once with the row's geometry; its JSON. */
async function runDemo(engine: Engine, g: DemoRowGeometry, dir: string, run: number): Promise<DemoJson> {
  const file = path.join(dir, `demo-${engine}-${run}.json`);
  const args = [
    cliPath(),
    'demo',
    `--prefill-tp=${g.prefillTp}`,
    `--decode-tp=${g.decodeTp}`,
    `--layers=${g.layers}`,
    `--blocks=${g.blocks}`,
    `--block-kib=${g.blockKib}`,
    `--heads=${g.heads}`,
    `--requests=${g.requests}`,
    `--in-flight=${g.inFlight}`,
    `--rounds=${g.rounds}`,
    `--engine=${engine}`,
    `--json=${file}`,
  ];
  try {
    await execFileP(process.execPath, args, { maxBuffer: 16 << 20, timeout: 600_000 });
  } catch (e) {
    const err = e as { stderr?: string; stdout?: string; message: string };
    const tail = `${err.stdout ?? ''}${err.stderr ?? ''}`.trim().split('\n').slice(-5).join(' | ');
    throw new Error(`nixl-node demo failed: ${tail || err.message}`);
  }
  const j = JSON.parse(fs.readFileSync(file, 'utf8')) as DemoJson;
  if (!j.ok) throw new Error(`nixl-node demo: ${j.failures.join('; ')}`);
  const got = j.geometry;
  for (const k of [
    'prefillTp',
    'decodeTp',
    'layers',
    'blocks',
    'blockKib',
    'heads',
    'requests',
    'inFlight',
    'rounds',
  ] as const)
    if (got[k] !== g[k]) throw new Error(`nixl-node demo ran ${k} ${got[k]}, the row asked for ${g[k]}`);
  return j;
}

const range = (xs: number[]): [number, number] => [Math.min(...xs), Math.max(...xs)];

/**
 * `runs` alternating runs of the demo (a child process) and of the baseline
 * (this process) on one engine.
 */
export async function benchDemo(
  engine: Engine,
  runs: number,
  g: DemoRowGeometry = DEMO_ROW,
): Promise<{ row: DemoRow; runs: DemoRun[] }> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-demo-row-'));
  const out: DemoRun[] = [];
  const memcpy: number[] = [];
  let baseline: DemoBaseline | undefined;
  let plan: string | undefined;
  try {
    for (let run = 0; run < runs; run++) {
      const first = run % 2 === 0 ? 'demo' : 'baseline';
      let demo: DemoJson | undefined;
      let base: BaselineRound[] | undefined;
      for (const which of first === 'demo' ? ['demo', 'baseline'] : ['baseline', 'demo']) {
        if (which === 'demo') {
          demo = await runDemo(engine, g, dir, run);
          plan ??= JSON.stringify(demo.plan);
          if (JSON.stringify(demo.plan) !== plan) throw new Error('nixl-node demo changed its requests between runs');
        } else {
          // The baseline runs the demo's requests: run 0 starts with the demo.
          baseline ??= await DemoBaseline.open(demo!, engine);
          base = await baseline.run();
        }
        memcpy.push(memcpyBaseline(1));
      }
      const d = side(demo!.rounds);
      const b = side(base!);
      const native = demo!.native;
      out.push({
        engine,
        run,
        first,
        demo: d,
        baseline: b,
        ratio: d.gbps / b.gbps,
        cpuRatio: d.gbPerCpuS / b.gbPerCpuS,
        demoMemcpyGbps: demo!.memcpyGbps,
        ...(native && 'gbps' in native ? { nativeGbps: native.gbps } : {}),
      });
    }
  } finally {
    await baseline?.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
  const later = (s: 'demo' | 'baseline') => out.flatMap((r) => (r[s].laterGbps.length ? r[s].laterGbps : [r[s].gbps]));
  const natives = out.flatMap((r) => (r.nativeGbps === undefined ? [] : [r.nativeGbps]));
  const row: DemoRow = {
    engine,
    geometry: { ...g },
    runs,
    demoGbps: median(later('demo')),
    demoRange: range(later('demo')),
    baselineGbps: median(later('baseline')),
    baselineRange: range(later('baseline')),
    ratio: median(out.map((r) => r.ratio)),
    ratioRange: range(out.map((r) => r.ratio)),
    demoFirstGbps: median(out.map((r) => r.demo.firstGbps)),
    baselineFirstGbps: median(out.map((r) => r.baseline.firstGbps)),
    demoGbPerCpuS: median(out.map((r) => r.demo.gbPerCpuS)),
    baselineGbPerCpuS: median(out.map((r) => r.baseline.gbPerCpuS)),
    cpuRatio: median(out.map((r) => r.cpuRatio)),
    cpuRatioRange: range(out.map((r) => r.cpuRatio)),
    memcpyGbps: median(memcpy),
    ...(natives.length ? { nativeGbps: median(natives) } : {}),
  };
  return { row, runs: out };
}
