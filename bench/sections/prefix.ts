import { benchFleetGguf } from '../fleet-gguf';
import { median } from '../stats';
import type { Section } from './section';

export const prefix: Section = {
  name: 'prefix',
  title: 'GGUF prefills reusing cached prefixes, per routing policy (minutes)',
  byDefault: false,
  async run({ quick, table }) {
    const n = quick ? 6 : 36;
    const runs = quick ? 1 : 3;
    console.log(
      `\n# Fleet routing with GGUF prefills reusing cached prefixes: 3 prefills of its own per policy ('small', 3 contexts each, KV events on ipc://) + 1 shared decode, ${n} streamed requests one at a time from 6 shared prefixes of ~1100 tokens, per policy and run (${runs} runs), the policies taking turns; possible = requests some prefill held a whole batch of when sent (as the prefills announce it); ratio = policy / round-robin of the same run; hit / miss TTFT = median TTFT of the policy's requests that reused a prefix / of those that did not`,
    );
    const fg = await benchFleetGguf(n, runs);
    if (fg.note) {
      console.log(`(${fg.note})`);
      return { json: {} };
    }
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
        'hit / miss TTFT',
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
        r.hitCost ? r.hitCost.toFixed(2) : '-',
      ]),
    );
    console.log(`prompts of ${fg.promptTokens} tokens (median); whole batches of ${fg.batchSize} tokens are reused`);
    return {
      json: { fleetGguf: fg },
      panels: (['load', 'precise'] as const).map((policy) => {
        const rows = fg.runs.filter((r) => r.policy === policy);
        return {
          title: `GGUF prefix reuse: ${policy} / round-robin`,
          reference: 1,
          bars: [
            { label: 'TTFT', value: median(rows.map((r) => r.ttftRatio)) },
            { label: 'prefill', value: median(rows.map((r) => r.prefillRatio)) },
          ],
        };
      }),
    };
  },
};
