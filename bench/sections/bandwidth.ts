import { type BwRow, benchBandwidth, bwCells } from '../loopback';
import { fmtBytes } from '../stats';
import type { Panel } from '../svg';
import type { Section } from './section';

export const bandwidth: Section = {
  name: 'bandwidth',
  title: 'READ bandwidth per block size against memcpy of the same bytes',
  byDefault: true,
  async run({ quick, engines, table }) {
    console.log(
      '\n# READ bandwidth: 64 MiB per request in blocks of each size; ratio = engine / memcpy of the same 64 MiB, each after the same idle gap; stream: 4 back to back',
    );
    const bw: BwRow[] = [];
    for (const e of engines) {
      // NIXL's own paths: in one process, and across processes (UCX picks the transport)
      bw.push(
        ...(await benchBandwidth({
          reps: quick ? 3 : 7,
          engine: e,
          paths: e === 'nixl' ? ['in-process', 'shared mapping'] : undefined,
        })),
      );
    }
    table(
      [
        'engine',
        'path',
        'block',
        'descs',
        'GB/s',
        'memcpy GB/s',
        'ratio',
        'copy-only ratio',
        'hop ms',
        'stream ratio',
        'stream memcpy GB/s',
      ],
      bw.map(bwCells),
    );
    const panels: Panel[] = [];
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
    return { json: { bandwidth: bw }, panels };
  },
};
