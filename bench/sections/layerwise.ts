import { LAYERS, type LayerwiseRow, benchLayerwise } from '../layerwise';
import { fmtBytes } from '../stats';
import { type Section, range } from './section';

export const layerwise: Section = {
  name: 'layerwise',
  title: 'a 32-layer KV pull, one request per layer as each is ready, against one request',
  byDefault: true,
  async run({ quick, engines, table }) {
    const rounds = quick ? 15 : 41;
    const sizes = quick
      ? [4 << 10, 64 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }))
      : [4 << 10, 16 << 10, 64 << 10, 256 << 10].map((blockBytes) => ({ blockBytes, blocksPerLayer: 8 }));
    console.log(
      `\n# Layer-wise KV pull: ${LAYERS} layers from another process, one request per layer posted as each layer is marked ready, against the same bytes in one request; ${rounds} rounds alternating; ratio = layer-wise / one-request time (goal <= 1.2)`,
    );
    const rows: LayerwiseRow[] = [];
    for (const e of engines) rows.push(...(await benchLayerwise(e, rounds, sizes)));
    table(
      ['engine', 'block', 'blocks/layer', 'bytes', 'one request us', 'layer-wise us', 'ratio', 'ratio range'],
      rows.map((r) => [
        r.engine,
        fmtBytes(r.blockBytes),
        r.blocksPerLayer,
        fmtBytes(r.bytes),
        r.oneRequestUs,
        r.layerwiseUs,
        r.ratio,
        range(r.ratioRange),
      ]),
    );
    return { json: { layerwise: rows } };
  },
};
