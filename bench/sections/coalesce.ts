import { benchCoalesce } from '../coalesce';
import type { Section } from './section';

export const coalesce: Section = {
  name: 'coalesce',
  title: "KvPuller's merged descriptors against one per block",
  byDefault: true,
  async run({ quick, engines, table }) {
    console.log(
      '\n# KvPuller, 16 KiB blocks x 8 regions, adjacent block ids; ratio = pull throughput / memcpy; gain = coalesced / per-block',
    );
    const co = await benchCoalesce(engines[0], quick ? 2 : 5);
    table(
      ['blocks/request', 'descs', 'merged descs', 'GB/s', 'merged GB/s', 'ratio', 'merged ratio', 'gain'],
      co.map((r) => [
        String(r.blocksPerRequest),
        r.descriptorsPlain,
        r.descriptorsCoalesced,
        r.plainGbps,
        r.coalescedGbps,
        r.plainRatio,
        r.coalescedRatio,
        r.gain,
      ]),
    );
    return {
      json: { coalesce: co },
      panels: [
        {
          title: 'Coalescing gain (merged / per-block throughput), 16 KiB blocks',
          reference: 1,
          bars: co.map((r) => ({ label: `${r.blocksPerRequest} blocks/request`, value: r.gain })),
        },
      ],
    };
  },
};
