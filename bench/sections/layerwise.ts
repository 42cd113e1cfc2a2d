import { LAYERS, type LayerwiseRow, benchLayerwise } from '../layerwise';
import { fmtBytes } from '../stats';
import { type Section, range } from './section';

export const layerwise: Section = {
  name: 'layerwise',
  title: 'a 32-layer KV pull, one request per layer or one layered request posted layer by layer, against one request',
  byDefault: true,
  async run({ quick, engines, table }) {
    const rounds = quick ? 15 : 41;
    const sizes = quick
      ? [4 << 10, 64 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }))
      : [4 << 10, 16 << 10, 64 << 10, 256 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }));
    console.log(
      `\n# Layer-wise KV pull: ${LAYERS} layers from another process, one request per layer posted as each layer is marked ready, and one layered request (makeLayeredXfer) whose layers are posted with postLayer as each is ready, against the same bytes in one request; ${rounds} rounds, the three forms rotating; ratio = its time / one-request time (goal <= 1.2)`,
    );
    const rows: LayerwiseRow[] = [];
    for (const e of engines) rows.push(...(await benchLayerwise(e, rounds, sizes)));
    table(
      [
        'engine',
        'block',
        'blocks/layer',
        'bytes',
        'one request us',
        'per-layer requests us',
        'ratio',
        'ratio range',
        'layered us',
        'layered ratio',
        'layered range',
      ],
      rows.map((r) => [
        r.engine,
        fmtBytes(r.blockBytes),
        r.blocksPerLayer,
        fmtBytes(r.bytes),
        r.oneRequestUs,
        r.layerwiseUs,
        r.ratio,
        range(r.ratioRange),
        r.layeredUs,
        r.layeredRatio,
        range(r.layeredRatioRange),
      ]),
    );
    return { json: { layerwise: rows } };
  },
};
