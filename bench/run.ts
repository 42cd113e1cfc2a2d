// nixl-node bench / npm run bench [-- --json out.json] [--svg out.svg] [--quick] [--only bandwidth,coalesce,handshake,grid]
// Every figure is a ratio against a baseline measured in the same run:
// memcpy for copies, the raw ZMQ / HTTP round trip for handshakes.
import * as fs from 'node:fs';
import * as os from 'node:os';
import { makeCerts } from './certs';
import { benchCoalesce } from './coalesce';
import { benchHandshake } from './handshake';
import { benchGrid, gridCells, NIXLBENCH_DEFAULTS, QUICK, type GridCold, type GridOptions, type GridRow } from './grid';
import { benchNative, nativeGrid } from './native';
import { benchServing, servingFigures, servingPanels } from './serving';
import { benchFleet } from './fleet';
import { benchFleetGguf } from './fleet-gguf';
import { benchTracing } from './tracing';
import { proxySection } from './proxy';
import { benchIndex } from './kv-index';
import { NixlError, engines } from '../lib';
import type { Engine } from './agents';
import { benchBandwidth, bwCells, type BwRow } from './loopback';
import { benchMultiturn } from './multiturn';
import { benchMultiturnGguf } from './multiturn-gguf';
import { benchDemo, DEMO_ROW, type DemoRow, type DemoRun } from './demo';
import { benchPush } from './push';
import { benchLayerwise, LAYERS, type LayerwiseRow } from './layerwise';
import { modelPath } from '../lib/serving/models/test-models';
import { fmtBytes, median } from './stats';
import { barChart, type Panel } from './svg';
export { NIXLBENCH_DEFAULTS, QUICK, type GridOptions } from './grid';

/** The bench's sections, in the order they run. */
export const SECTIONS = [
  'bandwidth',
  'native',
  'coalesce',
  'handshake',
  'tracing',
  'proxy',
  'serving',
  'multiturn',
  'push',
  'fleet',
  'index',
  'prefix',
  'grid',
  'layerwise',
  'demo',
];
/** What runs when no section is named: all but the grid, the GGUF fleet and the demo (minutes each). */
export const DEFAULT_SECTIONS = SECTIONS.filter((s) => s !== 'grid' && s !== 'prefix' && s !== 'demo');

function table(head: string[], rows: Array<Array<string | number>>): void {
  const cells = rows.map((r) =>
    r.map((c) => (typeof c === 'number' ? (Number.isInteger(c) ? String(c) : c.toFixed(2)) : c)),
  );
  const w = head.map((h, i) => Math.max(h.length, ...cells.map((r) => r[i].length)));
  console.log(head.map((h, i) => (i === 0 ? h.padEnd(w[i]) : h.padStart(w[i]))).join('  '));
  for (const r of cells) console.log(r.map((c, i) => (i === 0 ? c.padEnd(w[i]) : c.padStart(w[i]))).join('  '));
}

/** What the bench runs (cli/bench.ts parses them from the command line). */
export interface BenchOptions {
  /** Write the results as JSON here. */
  json?: string;
  /** Write a bar chart here. */
  svg?: string;
  /** Fewer repetitions. */
  quick: boolean;
  /** Sections to run (of SECTIONS). Default DEFAULT_SECTIONS. */
  only?: readonly string[];
  /** The grid's sizes and iterations, when `only` names it. Default nixlbench's (QUICK with quick). */
  grid?: GridOptions;
}

export async function runBench(o: BenchOptions): Promise<void> {
  const quick = o.quick;
  const only = o.only ?? DEFAULT_SECTIONS;
  const grid = only.includes('grid') ? (o.grid ?? (quick ? QUICK : NIXLBENCH_DEFAULTS)) : undefined;
  const unknown = only.filter((x) => !SECTIONS.includes(x));
  if (unknown.length)
    throw new NixlError(
      `--only: unknown section(s) ${unknown.join(', ')} (expected ${SECTIONS.join(', ')})`,
      'NIXL_ERR_INVALID_PARAM',
    );
  // Both engines side by side when NIXL is compiled in; NIXL_NODE_ENGINE picks one.
  const runEngines: Engine[] = process.env.NIXL_NODE_ENGINE
    ? [process.env.NIXL_NODE_ENGINE as Engine]
    : engines.includes('nixl')
      ? ['loopback', 'nixl']
      : ['loopback'];
  const engine = runEngines.join(' + ');
  const cpu = os.cpus();
  const machine = `${cpu[0]?.model ?? 'cpu'} x${cpu.length}, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB RAM, ${os.platform()} ${os.release()}, node ${process.version}`;
  console.log(`nixl-node bench (${engine} engine) on ${machine}`);
  const result: Record<string, unknown> = { machine, engine, date: new Date().toISOString() };
  const panels: Panel[] = [];

  if (only.includes('bandwidth')) {
    console.log(
      '\n# READ bandwidth: 64 MiB per request in blocks of each size; ratio = engine / memcpy of the same 64 MiB',
    );
    const bw: BwRow[] = [];
    for (const e of runEngines) {
      // NIXL's own paths: in one process, and across processes (UCX picks the transport)
      bw.push(
        ...(await benchBandwidth({
          reps: quick ? 3 : 7,
          engine: e,
          paths: e === 'nixl' ? ['in-process', 'shared mapping'] : undefined,
        })),
      );
    }
    table(['engine', 'path', 'block', 'descs', 'GB/s', 'memcpy GB/s', 'ratio', 'copy-only ratio'], bw.map(bwCells));
    result.bandwidth = bw;
    for (const key of new Set(bw.map((r) => `${r.engine}|${r.path}`))) {
      const [e, path] = key.split('|');
      panels.push({
        title: `READ / memcpy, ${e}, ${path}`,
        reference: 1,
        bars: bw
          .filter((r) => r.engine === e && r.path === path)
          .map((r) => ({ label: fmtBytes(r.blockBytes), value: r.ratio })),
      });
    }
  }

  if (only.includes('native')) {
    console.log(
      '\n# nixl-node / a native program on the same NIXL: 64 MiB prepped READ between two processes, alternating round by round; contiguous ids merge, scattered ids do not',
    );
    const nat = quick ? await benchNative(3, 3) : await benchNative(9, 3);
    if ('skip' in nat) {
      console.log(`(skipped: ${nat.skip})`);
      result.native = nat;
    } else {
      table(
        [
          'block',
          'ids',
          'descs',
          'native GB/s',
          'native range',
          'nixl-node GB/s',
          'range',
          'ratio',
          'ratio range',
          'native post us/desc',
          'transfer() us',
        ],
        nat.map((r) => [
          fmtBytes(r.blockBytes),
          r.layout,
          r.descriptors,
          r.nativeGbps,
          `${r.nativeRange[0].toFixed(2)}-${r.nativeRange[1].toFixed(2)}`,
          r.bindingGbps,
          `${r.bindingRange[0].toFixed(2)}-${r.bindingRange[1].toFixed(2)}`,
          r.ratio,
          `${r.ratioRange[0].toFixed(2)}-${r.ratioRange[1].toFixed(2)}`,
          r.nativePostUsPerDesc,
          r.bindingPostUs,
        ]),
      );
      result.native = nat;
      panels.push({
        title: 'nixl-node / native NIXL program, 64 MiB READ',
        reference: 1,
        bars: nat.map((r) => ({
          label: `${fmtBytes(r.blockBytes)} ${r.layout === 'scattered' ? 'scat.' : 'cont.'}`,
          value: r.ratio,
        })),
      });
    }
  }

  if (only.includes('coalesce')) {
    console.log(
      '\n# KvPuller, 16 KiB blocks x 8 regions, adjacent block ids; ratio = pull throughput / memcpy; gain = coalesced / per-block',
    );
    const co = await benchCoalesce(runEngines[0], quick ? 2 : 5);
    table(
      ['blocks/request', 'descs', 'merged descs', 'GB/s', 'merged GB/s', 'ratio', 'merged ratio', 'gain'],
      co.map((r) => [
        String(r.blocksPerRequest),
        r.descriptorsPlain,
        r.descriptorsCoalesced,
        r.plainGbps,
        r.coalescedGbps,
        r.plainRatio,
        r.coalescedRatio,
        r.gain,
      ]),
    );
    result.coalesce = co;
    panels.push({
      title: 'Coalescing gain (merged / per-block throughput), 16 KiB blocks',
      reference: 1,
      bars: co.map((r) => ({ label: `${r.blocksPerRequest} blocks/request`, value: r.gain })),
    });
  }

  if (only.includes('handshake')) {
    const n = quick ? 50 : 300;
    console.log(
      `\n# Handshake latency, ${n} fetches of one rank's payload (64 regions, 4 KiB agent metadata); ratio = median / raw transport median`,
    );
    let certs: ReturnType<typeof makeCerts> | undefined;
    try {
      certs = makeCerts();
    } catch {
      console.log('(openssl not found: https rows skipped)');
    }
    const hs = await benchHandshake(n, certs && { cert: certs.serverCert, key: certs.serverKey, ca: certs.ca });
    if (certs) fs.rmSync(certs.dir, { recursive: true, force: true });
    table(
      ['method', 'median ms', 'p99 ms', 'raw median ms', 'raw p99 ms', 'ratio'],
      hs.map((r) => [r.method, r.medianMs, r.p99Ms, r.rawMedianMs, r.rawP99Ms, r.ratio]),
    );
    result.handshake = hs;
    panels.push({
      title: 'Handshake median / raw transport median',
      reference: 1,
      bars: hs.map((r) => ({ label: r.method, value: r.ratio })),
    });
  }

  if (only.includes('tracing')) {
    const n = quick ? 100 : 400;
    const rounds = quick ? 3 : 7;
    console.log(
      `\n# Serving proxy with tracing, ${n} requests x ${rounds} rounds (16 clients, proxy + prefill + decode in one process); ratio = requests/s / tracing off`,
    );
    const tr = await benchTracing(n, rounds);
    if (tr.note) console.log(`(${tr.note})`);
    table(
      ['mode', 'requests/s', 'min', 'max', 'ratio'],
      tr.rows.map((r) => [r.mode, r.requestsPerSecond, r.min, r.max, r.ratio]),
    );
    result.tracing = tr.rows;
    if (tr.rows.length)
      panels.push({
        title: 'Proxy throughput / tracing off',
        reference: 1,
        bars: tr.rows.map((r) => ({ label: r.mode, value: r.ratio })),
      });
  }

  if (only.includes('proxy')) result.proxy = await proxySection(quick, table, panels);

  if (only.includes('index')) {
    const r = benchIndex(quick);
    result.index = r;
    console.log(
      `\n# KV-event index: ${r.workers} workers x ${r.blocksPerWorker} blocks, ${r.promptTokens}-token prompts`,
    );
    table(
      ['', 'block updates/s', 'index alone/s', 'decision p50 us', 'decision p99 us', 'decision mean us'],
      [
        [
          'wall',
          Math.round(r.blocksPerSecond),
          Math.round(r.indexOnlyBlocksPerSecond),
          r.decisionP50Us,
          r.decisionP99Us,
          '',
        ],
        [
          'per CPU s',
          Math.round(r.blocksPerCpuSecond),
          Math.round(r.indexOnlyBlocksPerCpuSecond),
          '',
          '',
          r.decisionCpuUs,
        ],
      ],
    );
  }

  if (only.includes('serving')) {
    const n = quick ? 5 : 15;
    const maxTokens = quick ? 16 : 32;
    console.log(
      `\n# Serving a real model, ${n} streamed greedy requests x ${maxTokens} tokens, proxy in front: disaggregated (prefill + decode workers, KV over nixl-node) / co-located (one worker in both pools)`,
    );
    const sv = await benchServing(n, maxTokens);
    if (sv.note) console.log(`(${sv.note})`);
    else {
      table(
        ['config', 'TTFT ms', 'min', 'max', 'TTFT ratio', 'decode tok/s', 'decode ratio'],
        sv.rows.map((r) => [
          r.config,
          r.ttftMs,
          r.ttftMin,
          r.ttftMax,
          r.ttftRatio,
          r.decodeTokensPerSecond,
          r.decodeRatio,
        ]),
      );
      console.log(
        `model ${sv.model}; disaggregated TTFT spent on the KV (medians): saving ${(sv.shareSave * 100).toFixed(1)}%, moving ${(sv.shareMove * 100).toFixed(1)}%, loading ${(sv.shareLoad * 100).toFixed(1)}%; ${sv.kvBytesPerToken} KV bytes per token; ${sv.identical}/${sv.requests} answers the same text both ways`,
      );
      const f = servingFigures(sv.rows);
      console.log("\nAs vLLM's serving benchmark gives them (TPOT excludes the first token; ITL pools every gap):");
      table(f.head, f.cells);
      for (const r of sv.rows)
        console.log(
          `${r.config}: ${r.completed} requests in ${r.duration.toFixed(2)} s of its own: request throughput ${r.request_throughput.toFixed(2)} req/s, output token throughput ${r.output_throughput.toFixed(2)} tok/s`,
        );
      result.serving = sv;
      panels.push({
        title: 'Disaggregated / co-located (real model)',
        reference: 1,
        bars: sv.rows
          .filter((r) => r.config === 'disaggregated')
          .flatMap((r) => [
            { label: 'TTFT', value: r.ttftRatio },
            { label: 'decode tok/s', value: r.decodeRatio },
          ]),
      });
      panels.push(...servingPanels(sv.rows));
    }
  }

  if (only.includes('multiturn')) {
    const n = quick ? 3 : 9;
    const sizes = quick ? [1024, 8192] : [512, 2048, 8192, 32768];
    console.log(
      `\n# Multi-turn, synthetic model, proxy in front: turn 2's time to first token when its prefill reads turn 1's KV from the decode (conversation_id) / the same turn recomputed; ${n} of each per history, alternating. Synthetic "compute" is hashing: the ratio is what the read costs against that, not what a real model saves`,
    );
    const mt = await benchMultiturn(n, sizes);
    table(
      ['history tokens', 'reused', 'reuse TTFT ms', 'min', 'max', 'recompute ms', 'min', 'max', 'ratio'],
      mt.map((r) => [
        r.historyTokens,
        r.reusedTokens,
        r.reuseMs,
        r.reuseMin,
        r.reuseMax,
        r.recomputeMs,
        r.recomputeMin,
        r.recomputeMax,
        r.ratio,
      ]),
    );
    result.multiturn = mt;
    const gn = quick ? 3 : 7;
    // Bytes of turn 1's prompt: about 1.4 tokens each, the last within the 4096-token context.
    const gsizes = quick ? [768, 1536] : [768, 1536, 2304];
    console.log(
      `\n# Multi-turn, GGUF ('small', batch 512, no prefix cache), proxy in front: turn 2's time to first token when its prefill loads turn 1's state from the decode / the same turn recomputed; ${gn} of each per history, alternating; ratio min/max over the pairs; hold = the decode's time to hold turn 1 after answering`,
    );
    try {
      const g = await benchMultiturnGguf(gn, gsizes);
      table(
        [
          'prompt tokens',
          'reused',
          'reuse TTFT ms',
          'min',
          'max',
          'recompute ms',
          'min',
          'max',
          'ratio',
          'min',
          'max',
          'hold ms',
        ],
        g.map((r) => [
          r.promptTokens,
          r.reusedTokens,
          r.reuseMs,
          r.reuseMin,
          r.reuseMax,
          r.recomputeMs,
          r.recomputeMin,
          r.recomputeMax,
          r.ratio,
          r.ratioMin,
          r.ratioMax,
          r.holdMs,
        ]),
      );
      result.multiturnGguf = g;
    } catch (e) {
      if ((e as { code?: string }).code !== 'NIXL_ERR_NOT_SUPPORTED') throw e;
      console.log(`(GGUF rows skipped: ${(e as Error).message})`);
    }
  }

  if (only.includes('push')) {
    const n = quick ? 5 : 15;
    console.log(
      `\n# Push beside pull, synthetic model and GGUF ('small'; --quick: 'tiny'), proxy in front (docs/kv-push.md): streamed time to first token and the KV's move as the decode saw it (pull: its READ; push: its registration to the last WRITE, which takes in the prefill's compute when the decode registered first, so push GB/s is a lower bound, not the WRITE's speed); ${n} requests per row, modes alternating`,
    );
    const rows = await benchPush(runEngines, n, quick ? [1024] : [256, 4096, 16384]);
    // A GGUF too ('small'; --quick: 'tiny'): its KV is llama.cpp's state, which a push decode sizes from the prompt.
    let llama = true;
    try {
      require.resolve('node-llama-cpp');
    } catch {
      llama = false;
    }
    if (llama)
      rows.push(...(await benchPush(runEngines, n, quick ? [256] : [256, 1024], modelPath(quick ? 'tiny' : 'small'))));
    table(
      [
        'model',
        'engine',
        'transport',
        'mode',
        'prompt tokens',
        'KV bytes',
        'TTFT ms',
        'min',
        'max',
        'ratio',
        'move ms',
        'KV GB/s',
        'same text',
      ],
      rows.map((r) => [
        r.model,
        r.engine,
        r.transport,
        r.mode,
        r.promptTokens,
        fmtBytes(r.kvBytes),
        r.ttftMs,
        r.ttftMin,
        r.ttftMax,
        r.ttftRatio,
        r.moveMs,
        r.kvGBps,
        `${r.identical}/${r.requests}`,
      ]),
    );
    if (!llama) console.log('(GGUF rows skipped: node-llama-cpp is not installed)');
    result.push = rows;
  }

  if (grid) {
    const g = await runGrid(runEngines, grid);
    result.grid = g.rows;
    result.gridCold = g.cold;
    result.gridOptions = grid;
  }

  if (only.includes('layerwise')) {
    const rounds = quick ? 15 : 41;
    const sizes = quick
      ? [4 << 10, 64 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }))
      : [4 << 10, 16 << 10, 64 << 10, 256 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }));
    console.log(
      `\n# Layer-wise KV pull: ${LAYERS} layers from another process, one request per layer posted as each layer is marked ready, against the same bytes in one request; ${rounds} rounds alternating; ratio = layer-wise / one-request time (goal <= 1.2)`,
    );
    const rows: LayerwiseRow[] = [];
    for (const e of runEngines) rows.push(...(await benchLayerwise(e, rounds, sizes)));
    table(
      ['engine', 'block', 'blocks/layer', 'bytes', 'one request us', 'layer-wise us', 'ratio', 'ratio range'],
      rows.map((r) => [
        r.engine,
        fmtBytes(r.blockBytes),
        r.blocksPerLayer,
        fmtBytes(r.bytes),
        r.oneRequestUs,
        r.layerwiseUs,
        r.ratio,
        `${r.ratioRange[0].toFixed(2)}-${r.ratioRange[1].toFixed(2)}`,
      ]),
    );
    result.layerwise = rows;
  }

  if (only.includes('fleet')) {
    const n = quick ? 12 : 60;
    const rounds = quick ? 2 : 7;
    console.log(
      `\n# Fleet routing, synthetic model, 3 prefills (one 20x slower) + 1 decode: prefix hit rate (${n} requests from 12 shared prefixes, one at a time, each prefill caching its last 4); time of a round of ${n} requests 6 at a time (${rounds} rounds); ratio = policy / round-robin`,
    );
    const fl = await benchFleet(n, rounds);
    table(
      ['policy', 'prefix hits', 'round ms', 'min', 'max', 'ratio'],
      fl.rows.map((r) => [
        r.policy,
        `${(r.prefixHitRate * 100).toFixed(0)}%`,
        r.roundMs,
        r.roundMin,
        r.roundMax,
        r.ratio,
      ]),
    );
    result.fleet = fl;
    panels.push({
      title: 'Fleet routing: round time, load / round-robin',
      reference: 1,
      bars: fl.rows.filter((r) => r.policy === 'load').map((r) => ({ label: 'one slow prefill', value: r.ratio })),
    });
  }

  if (only.includes('prefix')) {
    const n = quick ? 6 : 36;
    const runs = quick ? 1 : 3;
    console.log(
      `\n# Fleet routing with GGUF prefills reusing cached prefixes: 3 prefills of its own per policy ('small', 3 contexts each, KV events on ipc://) + 1 shared decode, ${n} streamed requests one at a time from 6 shared prefixes of ~1100 tokens, per policy and run (${runs} runs), the policies taking turns; possible = requests some prefill held a whole batch of when sent (as the prefills announce it); ratio = policy / round-robin of the same run`,
    );
    const fg = await benchFleetGguf(n, runs);
    if (fg.note) console.log(`(${fg.note})`);
    else {
      table(
        [
          'run',
          'policy',
          'prefix hits',
          'of possible',
          'tokens reused',
          'of held',
          'TTFT ms',
          'p99',
          'TTFT ratio',
          'prefill ms',
          'prefill ratio',
        ],
        fg.runs.map((r, i) => [
          Math.floor(i / 3) + 1,
          r.policy,
          `${(r.hitRate * 100).toFixed(0)}%`,
          r.possible ? `${(r.possibleHitRate * 100).toFixed(0)}% of ${r.possible}` : '-',
          `${(r.reusedShare * 100).toFixed(0)}%`,
          r.possible ? `${(r.possibleReusedShare * 100).toFixed(0)}%` : '-',
          r.ttftMs,
          r.ttftP99Ms,
          r.ttftRatio,
          r.prefillMs,
          r.prefillRatio,
        ]),
      );
      console.log(`prompts of ${fg.promptTokens} tokens (median); whole batches of ${fg.batchSize} tokens are reused`);
      result.fleetGguf = fg;
      for (const policy of ['load', 'precise'] as const) {
        const rows = fg.runs.filter((r) => r.policy === policy);
        panels.push({
          title: `GGUF prefix reuse: ${policy} / round-robin`,
          reference: 1,
          bars: [
            { label: 'TTFT', value: median(rows.map((r) => r.ttftRatio)) },
            { label: 'prefill', value: median(rows.map((r) => r.prefillRatio)) },
          ],
        });
      }
    }
  }

  if (only.includes('demo')) {
    const runs = quick ? 1 : 3;
    const g = DEMO_ROW;
    console.log(
      `\n# The demo against the bench for the same blocks: nixl-node demo (a child process: prefill TP ${g.prefillTp} -> decode TP ${g.decodeTp}, ${g.layers} layers x K/V, ${(g.blockKib * 1024) / g.prefillTp / 1024} KiB blocks on a prefill rank, ${(g.blockKib * 1024) / g.decodeTp / 1024} KiB slices per decode rank, ${g.requests} requests x ${g.blocks / g.requests} blocks, ${g.inFlight} in flight per decode rank, ${g.rounds} rounds) / the same pulls through KvPuller in this process; ${runs} run(s), alternating; GB/s of rounds 2-${g.rounds}, round 1 (first touch) apart; ratio = demo / baseline per run, cpu ratio = the same of bytes per CPU second`,
    );
    const rows: DemoRow[] = [];
    const all: DemoRun[] = [];
    for (const e of runEngines) {
      const r = await benchDemo(e, runs);
      rows.push(r.row);
      all.push(...r.runs);
    }
    const rng = (x: [number, number]) => `${x[0].toFixed(2)}-${x[1].toFixed(2)}`;
    table(
      [
        'engine',
        'demo GB/s',
        'range',
        'baseline GB/s',
        'range',
        'ratio',
        'ratio range',
        'round 1 demo',
        'round 1 baseline',
        'demo GB/cpu-s',
        'baseline GB/cpu-s',
        'cpu ratio',
        'range',
        'memcpy GB/s',
        ...(rows.some((r) => r.nativeGbps !== undefined) ? ['native GB/s'] : []),
      ],
      rows.map((r) => [
        r.engine,
        r.demoGbps,
        rng(r.demoRange),
        r.baselineGbps,
        rng(r.baselineRange),
        r.ratio,
        rng(r.ratioRange),
        r.demoFirstGbps,
        r.baselineFirstGbps,
        r.demoGbPerCpuS,
        r.baselineGbPerCpuS,
        r.cpuRatio,
        rng(r.cpuRatioRange),
        r.memcpyGbps,
        ...(rows.some((x) => x.nativeGbps !== undefined) ? [r.nativeGbps ?? '-'] : []),
      ]),
    );
    result.demo = { rows, runs: all };
    panels.push({
      title: 'The demo / the same pulls in one process',
      reference: 1,
      bars: rows.map((r) => ({ label: r.engine, value: r.ratio })),
    });
  }

  const json = o.json;
  if (json) {
    fs.writeFileSync(
      json,
      JSON.stringify(result, (_k, v) => (typeof v === 'bigint' ? v.toString() : v), 2),
    );
    console.log(`\nwrote ${json}`);
  }
  const svg = o.svg;
  if (svg) {
    fs.writeFileSync(svg, barChart(`nixl-node bench, ${engine} engine`, panels, machine));
    console.log(`wrote ${svg}`);
  }
}

const fmtDist = (d: { avg: number; p99: number }) => `${d.avg.toFixed(1)}/${d.p99.toFixed(1)}`;

async function runGrid(runEngines: Engine[], o: GridOptions): Promise<{ rows: GridRow[]; cold: GridCold[] }> {
  const cells = gridCells(o);
  console.log(
    `\n# Grid (nixlbench's shape): READ and WRITE between two processes, ${cells.length} block x batch cells per op, ${o.numIter} iterations (${o.warmupIter} warm-up; blocks over 1 MiB: 1/${o.largeBlockIterFactor}); latencies avg/p99 in us: prep = making the request, post = the post call, transfer = post to completion`,
  );
  const rows: GridRow[] = [];
  const cold: GridCold[] = [];
  for (const e of runEngines) {
    let native: Awaited<ReturnType<typeof nativeGrid>> | undefined;
    if (e === 'nixl') {
      native = await nativeGrid(Math.max(...cells.map((c) => c.blockBytes * c.batch)));
      if ('skip' in native) console.log(`(native program skipped: ${native.skip})`);
    }
    const runNative = native && !('skip' in native) ? native : undefined;
    try {
      const g = await benchGrid(
        e,
        o,
        runNative && ((op, cell) => runNative.run(op, cell.blockBytes, cell.batch, cell.iterations, o.warmupIter)),
      );
      rows.push(...g.rows);
      cold.push(...g.cold);
    } finally {
      await runNative?.close();
    }
  }
  const withNative = rows.some((r) => r.native);
  table(
    [
      'engine',
      'op',
      'block',
      'batch',
      'GB/s',
      'prep us',
      'post us',
      'transfer us',
      ...(withNative ? ['native GB/s', 'native transfer us', 'ratio'] : []),
    ],
    rows.map((r) => [
      r.engine,
      r.op,
      fmtBytes(r.blockBytes),
      r.batch,
      r.gbps,
      fmtDist(r.prepUs),
      fmtDist(r.postUs),
      fmtDist(r.xferUs),
      ...(withNative ? (r.native ? [r.native.gbps, fmtDist(r.native.xferUs), r.ratio ?? 0] : ['-', '-', '-']) : []),
    ]),
  );
  console.log('\n# The first transfer of a fresh agent pair (cold), against the same cell warm');
  table(
    ['engine', 'op', 'block', 'batch', 'connect us', 'prep us', 'post us', 'transfer us', 'warm transfer us'],
    cold.map((c) => [
      c.engine,
      c.op,
      fmtBytes(c.blockBytes),
      c.batch,
      c.connectUs,
      c.prepUs,
      c.postUs,
      c.xferUs,
      c.warmXferUs,
    ]),
  );
  return { rows, cold };
}
