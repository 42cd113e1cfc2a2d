import { benchMultiturn } from '../multiturn';
import { benchMultiturnGguf } from '../multiturn-gguf';
import type { Section } from './section';

export const multiturn: Section = {
  name: 'multiturn',
  title: "turn 2 reading turn 1's KV from its decode against recomputing (synthetic, GGUF)",
  byDefault: true,
  async run({ quick, table }) {
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
    const json: Record<string, unknown> = { multiturn: mt };
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
      json.multiturnGguf = g;
    } catch (e) {
      if ((e as { code?: string }).code !== 'NIXL_ERR_NOT_SUPPORTED') throw e;
      console.log(`(GGUF rows skipped: ${(e as Error).message})`);
    }
    return { json };
  },
};
