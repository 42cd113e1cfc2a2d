import { benchNative } from '../native';
import { fmtBytes } from '../stats';
import { type Section, range } from './section';

export const native: Section = {
  name: 'native',
  title: 'nixl-node against a C++ program on the installed NIXL (when NIXL is compiled in)',
  byDefault: true,
  async run({ quick, table }) {
    console.log(
      '\n# nixl-node / a native program on the same NIXL: 64 MiB prepped READ between two processes, alternating round by round; contiguous ids merge, scattered ids do not',
    );
    const nat = quick ? await benchNative(3, 3) : await benchNative(9, 3);
    if ('skip' in nat) {
      console.log(`(skipped: ${nat.skip})`);
      return { json: { native: nat } };
    }
    table(
      [
        'block',
        'ids',
        'descs',
        'native GB/s',
        'native range',
        'nixl-node GB/s',
        'range',
        'ratio',
        'ratio range',
        'native post us/desc',
        'transfer() us',
      ],
      nat.map((r) => [
        fmtBytes(r.blockBytes),
        r.layout,
        r.descriptors,
        r.nativeGbps,
        range(r.nativeRange),
        r.bindingGbps,
        range(r.bindingRange),
        r.ratio,
        range(r.ratioRange),
        r.nativePostUsPerDesc,
        r.bindingPostUs,
      ]),
    );
    return {
      json: { native: nat },
      panels: [
        {
          title: 'nixl-node / native NIXL program, 64 MiB READ',
          reference: 1,
          bars: nat.map((r) => ({
            label: `${fmtBytes(r.blockBytes)} ${r.layout === 'scattered' ? 'scat.' : 'cont.'}`,
            value: r.ratio,
          })),
        },
      ],
    };
  },
};
