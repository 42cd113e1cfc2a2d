import { NixlError } from '../../lib/errors';
import { benchProxy } from '../proxy';
import type { Section } from './section';

export const proxy: Section = {
  name: 'proxy',
  title: 'the proxy alone over HTTP and ZeroMQ, against the client calling fake workers itself',
  byDefault: true,
  async run({ quick, table }) {
    const requests = quick ? 500 : 2000;
    const rounds = 3;
    console.log(
      `\n# Serving proxy alone: ${requests} requests x ${rounds} rounds, 32 clients, fake prefill and decode workers (no model); ratio = requests/s / the client calling prefill then decode itself`,
    );
    const r = await benchProxy(requests, rounds);
    table(
      ['mode', 'requests/s', 'min', 'max', 'p50 ms', 'p99 ms', 'proxy CPU us/req', 'ratio', 'p99 ratio', 'wrong'],
      r.rows.map((x) => [
        x.mode,
        x.requestsPerSecond,
        x.min,
        x.max,
        x.p50Ms,
        x.p99Ms,
        x.cpuUsPerRequest ?? '-',
        x.ratio,
        x.p99Ratio,
        `${x.wrong}/${x.checked}`,
      ]),
    );
    console.log(`load average during the rounds: ${r.loadAverage.map((l) => l.toFixed(2)).join(', ')}`);
    // A proxy that answers fast and wrong measured nothing: the bench fails.
    if (r.reasons)
      throw new NixlError(`proxy bench: wrong answers (first: ${r.reasons.join(' | ')})`, 'NIXL_ERR_MISMATCH');
    return {
      json: { proxy: r },
      panels: [
        {
          title: 'Proxy requests/s / client calling P then D itself',
          reference: 1,
          bars: r.rows.map((x) => ({ label: x.mode, value: x.ratio })),
        },
      ],
    };
  },
};
