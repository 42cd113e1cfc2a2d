// The KV-event decoder: vLLM's EventBatch in both generations (map events
// and positional arrays, mixed in one batch), hashes as uint64, int64 and
// bin, and hostile payloads dropped and counted, never thrown.
import fc from 'fast-check';
import { Packr } from 'msgpackr';
import { describe, expect, it } from 'vitest';
import { BatchRefused, decodeBatch, hashValue } from '../../lib/serving/kv-index/decode';

const packr = new Packr({ useRecords: false, variableMapSize: true, useBigInt64: true } as never);
const pack = (v: unknown) => packr.pack(v);
const H1 = 8866452693264111234n;
const H2 = 807986237951177663n;
const range = (a: number, b: number) => Array.from({ length: b - a + 1 }, (_, i) => a + i);

// The spec's worked example (§8): 228 bytes, a map event in an array batch.
const EXAMPLE = Buffer.from(
  [
    '93cb41daa8dbe0200000918b',
    'a474797065ab426c6f636b53746f726564',
    'ac626c6f636b5f686173686573 92 cf7b0bf7bf7fd01682 cf0b368b33d87bf3bf',
    'b1706172656e745f626c6f636b5f68617368c0',
    `a9746f6b656e5f696473dc0020${range(1, 32)
      .map((n) => n.toString(16).padStart(2, '0'))
      .join('')}`,
    'aa626c6f636b5f73697a6510',
    'a76c6f72615f6964c0',
    'a66d656469756da3475055',
    'a96c6f72615f6e616d65c0',
    'aa65787472615f6b65797392c0c0',
    'a967726f75705f69647800',
    'b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e',
    '00',
  ]
    .join('')
    .replace(/ /g, ''),
  'hex',
);

describe('EventBatch decoder', () => {
  it("reads the spec's worked example (map events, uint64 hashes)", () => {
    expect(EXAMPLE.length).toBe(228);
    const b = decodeBatch(EXAMPLE);
    expect(b.ts).toBe(1789095808.5);
    expect(b.dpRank).toBe(0);
    expect(b.dropped).toEqual({});
    expect(b.events).toEqual([
      {
        type: 'BlockStored',
        blockHashes: [H1, H2],
        parent: null,
        tokenIds: range(1, 32),
        blockSize: 16,
        medium: 'GPU',
        loraName: null,
      },
    ]);
  });

  it('reads map and positional events mixed in one batch, 7- and 8-element arrays, batch as array(2) or map', () => {
    const positional7 = ['BlockStored', [H1], null, range(1, 16), 16, null, 'GPU'];
    const positional8 = ['BlockStored', [H2], H1, range(17, 32), 16, null, 'CPU', 'adapter'];
    const removed = new Map<string, unknown>([
      ['type', 'BlockRemoved'],
      ['block_hashes', [H2]],
      ['medium', 'GPU'],
    ]);
    const cleared = ['AllBlocksCleared'];
    for (const batch of [
      [1.5, [positional7, positional8, removed, cleared]],
      new Map<string, unknown>([
        ['ts', 1.5],
        ['events', [positional7, positional8, removed, cleared]],
        ['data_parallel_rank', 2],
      ]),
    ]) {
      const b = decodeBatch(pack(batch));
      expect(b.dropped).toEqual({});
      expect(b.events.map((e) => e.type)).toEqual(['BlockStored', 'BlockStored', 'BlockRemoved', 'AllBlocksCleared']);
      expect(b.events[1]).toMatchObject({ parent: H1, medium: 'CPU', loraName: 'adapter', blockHashes: [H2] });
      expect(b.events[2]).toEqual({ type: 'BlockRemoved', blockHashes: [H2], medium: 'GPU' });
    }
  });

  it('takes hashes as uint64 >= 2^63, int64 (bits reinterpreted) and bin (last 8 bytes, big-endian)', () => {
    const big = (1n << 64n) - 5n;
    expect(hashValue(big)).toBe(big);
    expect(hashValue(-5n)).toBe(big);
    expect(hashValue(7)).toBe(7n);
    const digest = Buffer.alloc(32, 0xaa);
    digest.writeBigUInt64BE(H1, 24);
    expect(hashValue(digest)).toBe(H1);
    expect(hashValue(Buffer.from([1, 2]))).toBe(0x102n);
    expect(hashValue(1n << 64n)).toBeUndefined();
    expect(hashValue(1.5)).toBeUndefined();
    expect(hashValue('x')).toBeUndefined();
    // On the wire: d3 (int64 -5) and cf (uint64) are the same hash.
    const b = decodeBatch(
      Buffer.concat([
        Buffer.from('9201', 'hex'),
        pack([
          ['BlockRemoved', [-5n]],
          ['BlockRemoved', [big]],
          ['BlockRemoved', [digest]],
        ]),
      ]),
    );
    expect(b.events.map((e) => (e as { blockHashes: bigint[] }).blockHashes[0])).toEqual([big, big, H1]);
  });

  it('takes a store without tokens (offload tiers)', () => {
    const e = new Map<string, unknown>([
      ['type', 'BlockStored'],
      ['block_hashes', [H1]],
      ['parent_block_hash', null],
      ['token_ids', []],
      ['block_size', 0],
      ['medium', 'CPU'],
    ]);
    expect(decodeBatch(pack([0, [e], 0])).events[0]).toMatchObject({ tokenIds: [], medium: 'CPU' });
  });

  it('drops and counts unknown types, wrong types, wrong lengths and oversized lists', () => {
    const b = decodeBatch(
      pack([
        0,
        [
          ['Mystery', 1],
          new Map([['type', 'BlockStored']]),
          ['BlockStored', [H1], null, [1, 2, 3], 16],
          ['BlockStored', ['x'], null, range(1, 16), 16],
          ['BlockRemoved', range(1, 10)],
          42,
          ['AllBlocksCleared'],
        ],
      ]),
      { maxBlocks: 5 },
    );
    expect(b.events).toEqual([{ type: 'AllBlocksCleared' }]);
    expect(b.dropped).toEqual({ unknown_type: 1, wrong_type: 3, wrong_length: 1, too_large: 1 });
    expect(() => decodeBatch(Buffer.from([0xc1]))).toThrow(BatchRefused);
    expect(() => decodeBatch(pack({ a: 1 }))).toThrow(BatchRefused);
    expect(() => decodeBatch(pack([1, 2, 3, 4]))).toThrow(BatchRefused);
    expect(() => decodeBatch(pack([0, range(1, 10)]), { maxEvents: 5 })).toThrow(BatchRefused);
  });

  it('never throws anything but BatchRefused on random bytes or random msgpack (fixed seed)', () => {
    fc.assert(
      fc.property(
        fc.oneof(
          fc.uint8Array({ maxLength: 300 }),
          fc.anything().map((v) => pack([0, [v, v]])),
        ),
        (bytes) => {
          try {
            const b = decodeBatch(bytes);
            expect(Array.isArray(b.events)).toBe(true);
          } catch (e) {
            expect(e).toBeInstanceOf(BatchRefused);
          }
        },
      ),
      { seed: 46, numRuns: 2000 },
    );
  });
});
