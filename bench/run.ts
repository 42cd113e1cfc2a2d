// nixl-node bench / npm run bench [-- --json out.json] [--svg out.svg] [--quick] [--only SECTION,...]
// (the sections: SECTIONS below; `nixl-node bench --help` lists them).
// Every figure is a ratio against a baseline measured in the same run:
// memcpy for copies, the raw ZMQ / HTTP round trip for handshakes.
import * as fs from 'node:fs';
import * as os from 'node:os';
import { NixlError, engines } from '../lib';
import type { Engine } from './agents';
import { type GridOptions, NIXLBENCH_DEFAULTS, QUICK } from './grid';
import { bandwidth } from './sections/bandwidth';
import { coalesce } from './sections/coalesce';
import { demo } from './sections/demo';
import { fleet } from './sections/fleet';
import { grid } from './sections/grid';
import { handshake } from './sections/handshake';
import { kvIndex } from './sections/kv-index';
import { layerwise } from './sections/layerwise';
import { multiturn } from './sections/multiturn';
import { native } from './sections/native';
import { prefix } from './sections/prefix';
import { proxy } from './sections/proxy';
import { push } from './sections/push';
import { type Section, table } from './sections/section';
import { serving } from './sections/serving';
import { tracing } from './sections/tracing';
import { barChart, type Panel } from './svg';
export { NIXLBENCH_DEFAULTS, QUICK, type GridOptions } from './grid';

/** The bench's sections, in the order they run (and their JSON keys appear). */
export const SECTIONS: readonly Section[] = [
  bandwidth,
  native,
  coalesce,
  handshake,
  tracing,
  proxy,
  kvIndex,
  serving,
  multiturn,
  push,
  grid,
  layerwise,
  fleet,
  prefix,
  demo,
];
/** What runs when --only names nothing. */
export const DEFAULT_SECTIONS = SECTIONS.filter((s) => s.byDefault).map((s) => s.name);

/** --only's lines for --help: each section, what it measures, and whether it runs by default. */
export function sectionsHelp(indent: string): string {
  const w = Math.max(...SECTIONS.map((s) => s.name.length));
  return SECTIONS.map((s) => `${indent}${s.name.padEnd(w)}  ${s.byDefault ? '' : '(ask for it) '}${s.title}`).join(
    '\n',
  );
}

/** What the bench runs (cli/bench.ts parses them from the command line). */
export interface BenchOptions {
  /** Write the results as JSON here. */
  json?: string;
  /** Write a bar chart here. */
  svg?: string;
  /** Fewer repetitions. */
  quick: boolean;
  /** Sections to run (names of SECTIONS). Default DEFAULT_SECTIONS. */
  only?: readonly string[];
  /** The grid's sizes and iterations, when `only` names it. Default nixlbench's (QUICK with quick). */
  grid?: GridOptions;
}

export async function runBench(o: BenchOptions): Promise<void> {
  const only = o.only ?? DEFAULT_SECTIONS;
  const names = SECTIONS.map((s) => s.name);
  const unknown = only.filter((x) => !names.includes(x));
  if (unknown.length)
    throw new NixlError(
      `--only: unknown section(s) ${unknown.join(', ')} (expected ${names.join(', ')})`,
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
  const ctx = {
    quick: o.quick,
    engines: runEngines,
    grid: o.grid ?? (o.quick ? QUICK : NIXLBENCH_DEFAULTS),
    table,
  };
  for (const section of SECTIONS) {
    if (!only.includes(section.name)) continue;
    const out = await section.run(ctx);
    Object.assign(result, out.json);
    panels.push(...(out.panels ?? []));
  }

  if (o.json) {
    fs.writeFileSync(
      o.json,
      JSON.stringify(result, (_k, v) => (typeof v === 'bigint' ? v.toString() : v), 2),
    );
    console.log(`\nwrote ${o.json}`);
  }
  if (o.svg) {
    fs.writeFileSync(o.svg, barChart(`nixl-node bench, ${engine} engine`, panels, machine));
    console.log(`wrote ${o.svg}`);
  }
}
