import { benchTracing } from '../tracing';
import type { Section } from './section';

export const tracing: Section = {
  name: 'tracing',
  title: "the proxy's throughput with tracing off, a no-op tracer and exporting",
  byDefault: true,
  async run({ quick, table }) {
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
    return {
      json: { tracing: tr.rows },
      panels: tr.rows.length
        ? [
            {
              title: 'Proxy throughput / tracing off',
              reference: 1,
              bars: tr.rows.map((r) => ({ label: r.mode, value: r.ratio })),
            },
          ]
        : [],
    };
  },
};
