import { DEMO_ROW, type DemoRow, type DemoRun, benchDemo } from '../demo';
import { type Section, range } from './section';

export const demo: Section = {
  name: 'demo',
  title: 'the demo (a child process) against the same pulls in this process (minutes)',
  byDefault: false,
  async run({ quick, engines, table }) {
    const runs = quick ? 1 : 3;
    const g = DEMO_ROW;
    console.log(
      `\n# The demo against the bench for the same blocks: nixl-node demo (a child process: prefill TP ${g.prefillTp} -> decode TP ${g.decodeTp}, ${g.layers} layers x K/V, ${(g.blockKib * 1024) / g.prefillTp / 1024} KiB blocks on a prefill rank, ${(g.blockKib * 1024) / g.decodeTp / 1024} KiB slices per decode rank, ${g.requests} requests x ${g.blocks / g.requests} blocks, ${g.inFlight} in flight per decode rank, ${g.rounds} rounds) / the same pulls through KvPuller in this process; ${runs} run(s), alternating; GB/s of rounds 2-${g.rounds}, round 1 (first touch) apart; ratio = demo / baseline per run, cpu ratio = the same of bytes per CPU second`,
    );
    const rows: DemoRow[] = [];
    const all: DemoRun[] = [];
    for (const e of engines) {
      const r = await benchDemo(e, runs);
      rows.push(r.row);
      all.push(...r.runs);
    }
    const withNative = rows.some((r) => r.nativeGbps !== undefined);
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
        ...(withNative ? ['native GB/s'] : []),
      ],
      rows.map((r) => [
        r.engine,
        r.demoGbps,
        range(r.demoRange),
        r.baselineGbps,
        range(r.baselineRange),
        r.ratio,
        range(r.ratioRange),
        r.demoFirstGbps,
        r.baselineFirstGbps,
        r.demoGbPerCpuS,
        r.baselineGbPerCpuS,
        r.cpuRatio,
        range(r.cpuRatioRange),
        r.memcpyGbps,
        ...(withNative ? [r.nativeGbps ?? '-'] : []),
      ]),
    );
    return {
      json: { demo: { rows, runs: all } },
      panels: [
        {
          title: 'The demo / the same pulls in one process',
          reference: 1,
          bars: rows.map((r) => ({ label: r.engine, value: r.ratio })),
        },
      ],
    };
  },
};
