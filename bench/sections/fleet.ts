import { benchFleet } from '../fleet';
import type { Section } from './section';

export const fleet: Section = {
  name: 'fleet',
  title: "the proxy's 'load' policy against round-robin, one of 3 synthetic prefills slow",
  byDefault: true,
  async run({ quick, table }) {
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
    return {
      json: { fleet: fl },
      panels: [
        {
          title: 'Fleet routing: round time, load / round-robin',
          reference: 1,
          bars: fl.rows.filter((r) => r.policy === 'load').map((r) => ({ label: 'one slow prefill', value: r.ratio })),
        },
      ],
    };
  },
};
