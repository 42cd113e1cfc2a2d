// The proxy's KV block index: blocks keyed by the proxy's own chain over
// token ids (any publisher hash works), removals and tokenless stores through
// the engine-hash map, longest-run matching with tier weights, speculative
// entries that expire, per-worker bounds, and hostile event streams that
// never throw and never grow it past its bounds.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import type { KvEvent } from '../../lib/serving/kv-index/decode';
import { KvBlockIndex, promptKeys } from '../../lib/serving/kv-index/index';

const BS = 4;
const toks = (n: number, base = 0) => Array.from({ length: n }, (_, i) => base + i);
const stored = (hashes: bigint[], parent: bigint | null, tokenIds: number[], medium = 'GPU'): KvEvent => ({
  type: 'BlockStored',
  blockHashes: hashes,
  parent,
  tokenIds,
  blockSize: BS,
  medium,
  loraName: null,
});

describe('KvBlockIndex', () => {
  it("keys blocks by the prompt's token chain, whatever hashes the publisher uses", () => {
    const ix = new KvBlockIndex();
    const prompt = toks(12); // 3 blocks
    // Worker a announces blocks 0-1 then 2 with a parent; b the same tokens under other hashes.
    ix.apply('a', [stored([11n, 12n], null, prompt.slice(0, 8)), stored([13n], 12n, prompt.slice(8, 12))]);
    ix.apply('b', [stored([0xffff_ffff_ffff_fff0n], null, prompt.slice(0, 4))]);
    const m = ix.match(promptKeys(prompt, BS), ['a', 'b', 'c']);
    expect(m.get('a')).toEqual({ blocks: 3, weight: 3 });
    expect(m.get('b')).toEqual({ blocks: 1, weight: 1 });
    expect(m.get('c')).toEqual({ blocks: 0, weight: 0 });
    // Another prompt sharing only block 0.
    const other = [...prompt.slice(0, 4), 99, 99, 99, 99];
    expect(ix.match(promptKeys(other, BS), ['a']).get('a')?.blocks).toBe(1);
  });

  it('counts the longest run from the first block only, tier-weighted (GPU 1, CPU 0.8)', () => {
    const ix = new KvBlockIndex();
    const prompt = toks(12);
    ix.apply('a', [stored([1n, 2n, 3n], null, prompt)]);
    ix.apply('a', [{ type: 'BlockRemoved', blockHashes: [2n], medium: 'GPU' }]);
    expect(ix.match(promptKeys(prompt, BS), ['a']).get('a')?.blocks).toBe(1); // the hole stops the run
    ix.apply('c', [stored([5n, 6n], null, prompt.slice(0, 8), 'CPU')]);
    expect(ix.match(promptKeys(prompt, BS), ['c']).get('c')?.weight).toBeCloseTo(1.6);
    // A tokenless store (offload) of a known block adds the tier; an unknown one is a counted no-op.
    const counts = ix.apply('c', [
      {
        type: 'BlockStored',
        blockHashes: [5n, 77n],
        parent: null,
        tokenIds: [],
        blockSize: 0,
        medium: 'GPU',
        loraName: null,
      },
    ]);
    expect(counts.unknown_block).toBe(1);
    expect(ix.match(promptKeys(prompt, BS), ['c']).get('c')?.weight).toBeCloseTo(1.8);
  });

  it('a store whose parent it never saw is dropped and counted; AllBlocksCleared and drop() forget the worker', () => {
    const ix = new KvBlockIndex();
    expect(ix.apply('a', [stored([2n], 1n, toks(4))]).unknown_parent).toBe(1);
    expect(ix.size).toBe(0);
    ix.apply('a', [stored([1n], null, toks(4))]);
    ix.apply('b', [stored([1n], null, toks(4))]);
    expect(ix.size).toBe(2);
    ix.apply('a', [{ type: 'AllBlocksCleared' }]);
    expect(ix.match(promptKeys(toks(4), BS), ['a', 'b']).get('a')?.blocks).toBe(0);
    ix.drop('b');
    expect(ix.size).toBe(0);
  });

  it('a speculative entry counts for its worker until its TTL, and an event confirms it', () => {
    const ix = new KvBlockIndex({ speculativeTtlMs: 1000 });
    const keys = promptKeys(toks(8), BS);
    ix.speculate('a', keys, 0);
    expect(ix.match(keys, ['a', 'b'], 500).get('a')?.blocks).toBe(2);
    expect(ix.match(keys, ['a'], 1500).get('a')?.blocks).toBe(0);
    ix.speculate('a', keys, 2000);
    ix.apply('a', [stored([1n, 2n], null, toks(8))]);
    expect(ix.match(keys, ['a'], 10_000).get('a')?.blocks).toBe(2);
  });

  it('keeps at most maxBlocksPerWorker blocks per worker (the oldest go) and maxWorkers workers', () => {
    const ix = new KvBlockIndex({ maxBlocksPerWorker: 10, maxWorkers: 2 });
    for (let i = 0; i < 50; i++) ix.apply('a', [stored([BigInt(i)], null, toks(4, i * 10))]);
    expect(ix.size).toBeLessThanOrEqual(10);
    expect(ix.size).toBeGreaterThanOrEqual(9);
    expect(ix.match(promptKeys(toks(4, 490), BS), ['a']).get('a')?.blocks).toBe(1);
    expect(ix.match(promptKeys(toks(4, 0), BS), ['a']).get('a')?.blocks).toBe(0);
    ix.apply('b', [stored([1n], null, toks(4))]);
    expect(ix.apply('c', [stored([1n], null, toks(4))]).too_many_workers).toBe(1);
    expect(ix.workers).toEqual(['a', 'b']);
  });

  it('hostile event streams never throw and never exceed the bounds (fixed seed)', () => {
    const hash = fc.bigInt({ min: 0n, max: 20n });
    const ev: fc.Arbitrary<KvEvent> = fc.oneof(
      fc.record({
        type: fc.constant('BlockStored' as const),
        blockHashes: fc.array(hash, { maxLength: 6 }),
        parent: fc.option(hash, { nil: null }),
        tokenIds: fc.array(fc.nat(3), { maxLength: 24 }),
        blockSize: fc.constantFrom(0, 1, 4),
        medium: fc.option(fc.constantFrom('GPU', 'CPU', 'FS', 'weird'), { nil: null }),
        loraName: fc.option(fc.string(), { nil: null }),
      }),
      fc.record({
        type: fc.constant('BlockRemoved' as const),
        blockHashes: fc.array(hash, { maxLength: 6 }),
        medium: fc.constant(null),
      }),
      fc.constant({ type: 'AllBlocksCleared' as const }),
    );
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.constantFrom('a', 'b', 'c', 'd'), ev), { maxLength: 60 }), (stream) => {
        const ix = new KvBlockIndex({ maxBlocksPerWorker: 8, maxWorkers: 3 });
        for (const [w, e] of stream) ix.apply(w, [e]);
        expect(ix.workers.length).toBeLessThanOrEqual(3);
        expect(ix.size).toBeLessThanOrEqual(24);
        const m = ix.match(promptKeys([0, 1, 2, 3, 0, 1, 2, 3], 4), ['a', 'b', 'c', 'd']);
        for (const v of m.values()) expect(v.blocks).toBeLessThanOrEqual(2);
      }),
      { seed: 46, numRuns: 500 },
    );
  });
});
