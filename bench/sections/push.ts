import { modelPath } from '../../lib/serving/models/test-models';
import { benchPush } from '../push';
import { fmtBytes } from '../stats';
import type { Section } from './section';

export const push: Section = {
  name: 'push',
  title: 'push beside pull through the proxy (synthetic model, and GGUF)',
  byDefault: true,
  async run({ quick, engines, table }) {
    const n = quick ? 5 : 15;
    console.log(
      `\n# Push beside pull, synthetic model and GGUF ('small'; --quick: 'tiny'), proxy in front (docs/kv-push.md): streamed time to first token and the KV's move as the decode saw it (pull: its READ; push: its registration to the last WRITE, which takes in the prefill's compute when the decode registered first, so push GB/s is a lower bound, not the WRITE's speed); ${n} requests per row, modes alternating`,
    );
    const rows = await benchPush(engines, n, quick ? [1024] : [256, 4096, 16384]);
    // A GGUF too ('small'; --quick: 'tiny'): its KV is llama.cpp's state, which a push decode sizes from the prompt.
    let llama = true;
    try {
      require.resolve('node-llama-cpp');
    } catch {
      llama = false;
    }
    if (llama)
      rows.push(...(await benchPush(engines, n, quick ? [256] : [256, 1024], modelPath(quick ? 'tiny' : 'small'))));
    table(
      [
        'model',
        'engine',
        'transport',
        'mode',
        'prompt tokens',
        'KV bytes',
        'TTFT ms',
        'min',
        'max',
        'ratio',
        'move ms',
        'KV GB/s',
        'same text',
      ],
      rows.map((r) => [
        r.model,
        r.engine,
        r.transport,
        r.mode,
        r.promptTokens,
        fmtBytes(r.kvBytes),
        r.ttftMs,
        r.ttftMin,
        r.ttftMax,
        r.ttftRatio,
        r.moveMs,
        r.kvGBps,
        `${r.identical}/${r.requests}`,
      ]),
    );
    if (!llama) console.log('(GGUF rows skipped: node-llama-cpp is not installed)');
    return { json: { push: rows } };
  },
};
