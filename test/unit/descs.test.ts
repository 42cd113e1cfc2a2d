import { describe, expect, it } from 'vitest';
import { adjacentRuns, allBlockDescs, blockDescIds, coalescedDescs, type BlockSlices } from '../../lib/kv/descs';

const whole = (base: bigint[], len: number): BlockSlices => ({
  baseAddrs: base,
  strides: base.map(() => len),
  offsets: base.map(() => 0),
  lens: base.map(() => len),
  devId: 0,
});

describe('KV descriptors', () => {
  it('prepped lists are region-major, ids are region * num_blocks + block', () => {
    const s: BlockSlices = {
      baseAddrs: [1000n, 50000n],
      strides: [100, 100],
      offsets: [25, 25],
      lens: [50, 50],
      devId: 3,
    };
    const d = allBlockDescs(s, 4);
    expect(d.length).toBe(2 * 4 * 3);
    expect([...d.slice(0, 6)]).toEqual([1025n, 50n, 3n, 1125n, 50n, 3n]);
    expect([...d.slice(12, 15)]).toEqual([50025n, 50n, 3n]);
    expect([...blockDescIds([4, 4], [3, 1])]).toEqual([3, 1, 7, 5]);
    expect([...blockDescIds([4, 6, 2], [1])]).toEqual([1, 5, 11]);
  });

  it('finds runs where both sides step by one', () => {
    expect(adjacentRuns([1, 2, 3, 7, 8], [10, 11, 12, 20, 22])).toEqual([
      [0, 3],
      [3, 4],
      [4, 5],
    ]);
    expect(adjacentRuns([5], [9])).toEqual([[0, 1]]);
  });

  it('coalesces runs only where both sides are contiguous', () => {
    const l = whole([0x10000n, 0x20000n], 16384);
    const r = whole([0x90000n, 0xa0000n], 16384);
    const m = coalescedDescs(l, r, [0, 1, 2, 5], [4, 5, 6, 9])!;
    expect(m.count).toBe(4); // 2 runs x 2 regions
    expect([...m.local.slice(0, 3)]).toEqual([0x10000n, 3n * 16384n, 0n]);
    expect([...m.remote.slice(0, 3)]).toEqual([0x90000n + 4n * 16384n, 3n * 16384n, 0n]);
    expect([...m.local.slice(3, 6)]).toEqual([0x10000n + 5n * 16384n, 16384n, 0n]);
    // a rank's slice of a bigger remote block is not contiguous: no merge
    const sliced: BlockSlices = { ...r, strides: [32768, 32768], offsets: [16384, 16384] };
    expect(coalescedDescs(l, sliced, [0, 1], [0, 1])).toBeUndefined();
    // nothing adjacent: no merge
    expect(coalescedDescs(l, r, [0, 2], [0, 2])).toBeUndefined();
  });
});
