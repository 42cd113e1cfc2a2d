import { benchServing, servingFigures, servingPanels } from '../serving';
import type { Section } from './section';

export const serving: Section = {
  name: 'serving',
  title: 'a generated llama GGUF (node-llama-cpp), disaggregated against co-located',
  byDefault: true,
  async run({ quick, table }) {
    const n = quick ? 5 : 15;
    const maxTokens = quick ? 16 : 32;
    console.log(
      `\n# Serving a real model, ${n} streamed greedy requests x ${maxTokens} tokens, proxy in front: disaggregated (prefill + decode workers, KV over nixl-node) / co-located (one worker in both pools)`,
    );
    const sv = await benchServing(n, maxTokens);
    if (sv.note) {
      console.log(`(${sv.note})`);
      return { json: {} };
    }
    table(
      ['config', 'TTFT ms', 'min', 'max', 'TTFT ratio', 'decode tok/s', 'decode ratio'],
      sv.rows.map((r) => [
        r.config,
        r.ttftMs,
        r.ttftMin,
        r.ttftMax,
        r.ttftRatio,
        r.decodeTokensPerSecond,
        r.decodeRatio,
      ]),
    );
    console.log(
      `model ${sv.model}; disaggregated TTFT spent on the KV (medians): saving ${(sv.shareSave * 100).toFixed(1)}%, moving ${(sv.shareMove * 100).toFixed(1)}%, loading ${(sv.shareLoad * 100).toFixed(1)}%; ${sv.kvBytesPerToken} KV bytes per token; ${sv.identical}/${sv.requests} answers the same text both ways`,
    );
    const f = servingFigures(sv.rows);
    console.log("\nAs vLLM's serving benchmark gives them (TPOT excludes the first token; ITL pools every gap):");
    table(f.head, f.cells);
    for (const r of sv.rows)
      console.log(
        `${r.config}: ${r.completed} requests in ${r.duration.toFixed(2)} s of its own: request throughput ${r.request_throughput.toFixed(2)} req/s, output token throughput ${r.output_throughput.toFixed(2)} tok/s`,
      );
    return {
      json: { serving: sv },
      panels: [
        {
          title: 'Disaggregated / co-located (real model)',
          reference: 1,
          bars: sv.rows
            .filter((r) => r.config === 'disaggregated')
            .flatMap((r) => [
              { label: 'TTFT', value: r.ttftRatio },
              { label: 'decode tok/s', value: r.decodeRatio },
            ]),
        },
        ...servingPanels(sv.rows),
      ],
    };
  },
};
