import { type GridCold, type GridRow, benchGrid, gridCells } from '../grid';
import { nativeGrid } from '../native';
import { fmtBytes } from '../stats';
import type { Section } from './section';

const fmtDist = (d: { avg: number; p99: number }) => `${d.avg.toFixed(1)}/${d.p99.toFixed(1)}`;

export const grid: Section = {
  name: 'grid',
  title: "nixlbench's shape: READ and WRITE over block x batch sizes (minutes)",
  byDefault: false,
  async run({ engines, grid: o, table }) {
    const cells = gridCells(o);
    console.log(
      `\n# Grid (nixlbench's shape): READ and WRITE between two processes, ${cells.length} block x batch cells per op, ${o.numIter} iterations (${o.warmupIter} warm-up; blocks over 1 MiB: 1/${o.largeBlockIterFactor}); latencies avg/p99 in us: prep = making the request, post = the post call, transfer = post to completion`,
    );
    const rows: GridRow[] = [];
    const cold: GridCold[] = [];
    for (const e of engines) {
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
        ...(withNative ? ['native GB/s', 'native transfer us', 'ratio', 'ratio (median)'] : []),
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
        ...(withNative
          ? r.native
            ? [r.native.gbps, fmtDist(r.native.xferUs), r.ratio ?? 0, r.ratioMedian ?? 0]
            : ['-', '-', '-', '-']
          : []),
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
    return { json: { grid: rows, gridCold: cold, gridOptions: o } };
  },
};
