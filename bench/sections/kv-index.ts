import { benchIndex } from '../kv-index';
import type { Section } from './section';

export const kvIndex: Section = {
  name: 'index',
  title: "the proxy's KV-event index: block updates per second and routing decisions",
  byDefault: true,
  async run({ quick, table }) {
    const r = benchIndex(quick);
    console.log(
      `\n# KV-event index: ${r.workers} workers x ${r.blocksPerWorker} blocks, ${r.promptTokens}-token prompts` +
        ` (first pass, compiling: ${Math.round(r.coldBlocksPerCpuSecond)} block updates per CPU s)`,
    );
    table(
      ['', 'block updates/s', 'index alone/s', 'decision p50 us', 'decision p99 us', 'decision mean us'],
      [
        [
          'wall',
          Math.round(r.blocksPerSecond),
          Math.round(r.indexOnlyBlocksPerSecond),
          r.decisionP50Us,
          r.decisionP99Us,
          '',
        ],
        [
          'per CPU s',
          Math.round(r.blocksPerCpuSecond),
          Math.round(r.indexOnlyBlocksPerCpuSecond),
          '',
          '',
          r.decisionCpuUs,
        ],
      ],
    );
    return { json: { index: r } };
  },
};
