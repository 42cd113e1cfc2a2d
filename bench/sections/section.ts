// What a bench section is: a name for --only, a line for --help, and a run
// that prints its tables as it goes (a section takes seconds to minutes, so
// its header comes before its figures) and gives back its JSON keys and
// chart panels. bench/run.ts runs the registry in order.
import type { Engine } from '../agents';
import type { GridOptions } from '../grid';
import type { Panel } from '../svg';

export type Cell = string | number;

export interface SectionContext {
  /** Fewer repetitions. */
  quick: boolean;
  /** The engines of the run: both when NIXL is compiled in, NIXL_NODE_ENGINE's one when set. */
  engines: Engine[];
  /** The grid's sizes and iterations (the grid section's). */
  grid: GridOptions;
  /** Prints a table: the first column left-aligned, the rest right-aligned, numbers to 2 decimals. */
  table(head: string[], rows: Cell[][]): void;
}

export interface SectionOutput {
  /** Top-level keys of the bench's JSON, in order. */
  json: Record<string, unknown>;
  /** Bar-chart panels for --svg. */
  panels?: Panel[];
}

export interface Section {
  /** The name --only takes. */
  readonly name: string;
  /** One line for --help: what it measures against what. */
  readonly title: string;
  /** Runs when --only names nothing (false: minutes, or a child process; ask for it). */
  readonly byDefault: boolean;
  run(ctx: SectionContext): Promise<SectionOutput>;
}

export function table(head: string[], rows: Cell[][]): void {
  const cells = rows.map((r) =>
    r.map((c) => (typeof c === 'number' ? (Number.isInteger(c) ? String(c) : c.toFixed(2)) : c)),
  );
  const w = head.map((h, i) => Math.max(h.length, ...cells.map((r) => r[i].length)));
  console.log(head.map((h, i) => (i === 0 ? h.padEnd(w[i]) : h.padStart(w[i]))).join('  '));
  for (const r of cells) console.log(r.map((c, i) => (i === 0 ? c.padEnd(w[i]) : c.padStart(w[i]))).join('  '));
}

/** A [min, max] range as the tables print it. */
export const range = (x: readonly [number, number]): string => `${x[0].toFixed(2)}-${x[1].toFixed(2)}`;
