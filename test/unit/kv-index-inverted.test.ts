// The block index's inverted side (first block -> holders, for stored and
// speculative entries) against a brute-force recomputation from the
// workers' own maps, after every step of random event sequences: stores
// (chained, tokenless, CPU tier), removals, clears, workers dropped and
// restarted, speculative entries, and the bounds' evictions of both. The
// decision's matches are checked against the per-worker walk they replace.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import type { KvEvent } from '../../lib/serving/kv-index/decode';
import { KvBlockIndex, promptKeys } from '../../lib/serving/kv-index/index';

const BS = 2;
const WORKERS = ['a', 'b', 'c', 'd'];
const slotOf = (k: number) => k | 0;
const highOf = (k: number) => Math.floor(k / 0x100000000);
const byTuple = (x: number[], y: number[]) => x[0] - y[0] || x[1] - y[1] || x[2] - y[2];

type Step =
  | { op: 'store'; w: number; hashes: number[]; parent: number | null; tokens: number[]; cpu: boolean }
  | { op: 'tokenless'; w: number; hashes: number[] }
  | { op: 'remove'; w: number; hashes: number[] }
  | { op: 'clear'; w: number }
  | { op: 'drop'; w: number }
  | { op: 'restart'; w: number; tokens: number[] }
  | { op: 'speculate'; w: number; tokens: number[]; at: number }
  | { op: 'match'; tokens: number[]; at: number };

const w = fc.nat(WORKERS.length - 1);
const hashes = fc.array(fc.nat(12), { minLength: 1, maxLength: 4 });
// Two token values and two-token blocks: few distinct blocks, so workers share them often.
const toks = fc.array(fc.nat(1), { minLength: 0, maxLength: 10 });
const at = fc.integer({ min: 0, max: 3000 });
const step: fc.Arbitrary<Step> = fc.oneof(
  {
    weight: 5,
    arbitrary: fc.record({
      op: fc.constant('store' as const),
      w,
      hashes,
      parent: fc.option(fc.nat(12), { nil: null }),
      tokens: toks,
      cpu: fc.boolean(),
    }),
  },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('tokenless' as const), w, hashes }) },
  { weight: 2, arbitrary: fc.record({ op: fc.constant('remove' as const), w, hashes }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('clear' as const), w }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('drop' as const), w }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('restart' as const), w, tokens: toks }) },
  { weight: 6, arbitrary: fc.record({ op: fc.constant('speculate' as const), w, tokens: toks, at }) },
  { weight: 3, arbitrary: fc.record({ op: fc.constant('match' as const), tokens: toks, at }) },
);

const stored = (hs: number[], parent: number | null, tokens: number[], medium = 'GPU'): KvEvent => {
  const n = Math.min(hs.length, Math.floor(tokens.length / BS));
  return {
    type: 'BlockStored',
    blockHashes: hs.slice(0, n).map(BigInt),
    parent: parent === null ? null : BigInt(parent),
    tokenIds: tokens.slice(0, n * BS),
    blockSize: BS,
    medium,
    loraName: null,
  };
};

function apply(ix: KvBlockIndex, s: Step): void {
  const name = WORKERS[s.w as number];
  if (s.op === 'store') ix.apply(name, [stored(s.hashes, s.parent, s.tokens, s.cpu ? 'CPU' : 'GPU')]);
  else if (s.op === 'tokenless')
    ix.apply(name, [
      {
        type: 'BlockStored',
        blockHashes: s.hashes.map(BigInt),
        parent: null,
        tokenIds: [],
        blockSize: 0,
        medium: 'GPU',
        loraName: null,
      },
    ]);
  else if (s.op === 'remove')
    ix.apply(name, [{ type: 'BlockRemoved', blockHashes: s.hashes.map(BigInt), medium: null }]);
  else if (s.op === 'clear') ix.apply(name, [{ type: 'AllBlocksCleared' }]);
  else if (s.op === 'drop') ix.drop(name);
  else if (s.op === 'restart') ix.apply(name, [{ type: 'AllBlocksCleared' }, stored([1, 2, 3, 4, 5], null, s.tokens)]);
  else if (s.op === 'speculate') ix.speculate(name, promptKeys(s.tokens, BS), s.at);
}

/** The inverted side recomputed from the workers' own maps: first blocks held (bit 4) and speculated. */
function expectConsistent(ix: KvBlockIndex): void {
  const v = ix.views();
  const held: number[][] = [];
  const spec: number[][] = [];
  const ids = new Set<number>();
  for (const x of v.workers.values()) {
    ids.add(x.id);
    for (const [slot, val] of x.keys) if (val & 4) held.push([slot, x.id, val]);
    for (const [slot, val] of x.specFirst) spec.push([slot, x.id, val]);
  }
  expect(ids.size).toBe(v.workers.size);
  expect([...v.holders].sort(byTuple)).toEqual(held.sort(byTuple));
  expect([...v.specHolders].sort(byTuple)).toEqual(spec.sort(byTuple));
}

/** The per-worker walk: each candidate's own maps, from the first block to its first miss. */
function bruteMatch(ix: KvBlockIndex, keys: number[], now: number): Map<string, { blocks: number; weight: number }> {
  const v = ix.views();
  const out = new Map<string, { blocks: number; weight: number }>();
  for (const name of WORKERS) {
    const x = v.workers.get(name);
    const kmap = new Map(x?.keys ?? []);
    const smap = new Map(x?.spec ?? []);
    const fmap = new Map(x?.specFirst ?? []);
    let blocks = 0;
    let weight = 0;
    for (const k of keys) {
      const val = kmap.get(slotOf(k));
      const s = (blocks === 0 ? fmap : smap).get(slotOf(k));
      if (val !== undefined && val >>> 3 === highOf(k)) weight += [1, 0.8, 0.5][val & 3];
      else if (s !== undefined && s > now / 100) weight += 1;
      else break;
      blocks++;
    }
    out.set(name, { blocks, weight });
  }
  return out;
}

describe('KvBlockIndex inverted side', () => {
  it('equals a brute-force recomputation after every step of random event sequences (fixed seed)', () => {
    fc.assert(
      fc.property(fc.array(step, { minLength: 1, maxLength: 100 }), (steps) => {
        const ix = new KvBlockIndex({
          maxBlocksPerWorker: 6,
          maxWorkers: 3,
          maxSpeculative: 2,
          speculativeTtlMs: 1000,
        });
        for (const s of steps) {
          apply(ix, s);
          expectConsistent(ix);
          if (s.op === 'match') {
            const keys = promptKeys(s.tokens, BS);
            const got = ix.match(keys, WORKERS, s.at);
            const want = bruteMatch(ix, keys, s.at);
            for (const name of WORKERS) {
              expect(got.get(name)?.blocks).toBe(want.get(name)?.blocks);
              expect(got.get(name)?.weight).toBeCloseTo(want.get(name)?.weight ?? -1, 9);
            }
          }
        }
      }),
      { seed: 46, numRuns: 400 },
    );
  });

  it('gives a worker named twice among the candidates the same match, and forgets a dropped worker everywhere', () => {
    const ix = new KvBlockIndex();
    const prompt = [0, 1, 1, 0, 0, 0];
    ix.apply('a', [stored([1, 2, 3], null, prompt)]);
    ix.speculate('b', promptKeys(prompt, BS), 0);
    const m = ix.match(promptKeys(prompt, BS), ['a', 'b', 'a'], 0);
    expect([...m.values()]).toEqual([
      { blocks: 3, weight: 3 },
      { blocks: 3, weight: 3 },
    ]);
    const blocks = new Float64Array(3);
    const weight = new Float64Array(3);
    ix.matchInto(promptKeys(prompt, BS), ['a', 'b', 'a'], blocks, weight, 0);
    expect([...blocks]).toEqual([3, 3, 3]);
    ix.drop('a');
    ix.drop('b');
    expect(ix.views()).toEqual({ workers: new Map(), holders: [], specHolders: [] });
    // The ids come back for new workers, and nothing of the old ones is matched under them.
    ix.apply('c', [stored([9], null, [1, 1])]);
    expect(ix.match(promptKeys(prompt, BS), ['c']).get('c')?.blocks).toBe(0);
    // More workers than the decision's arrays first hold: each its own run.
    const names = Array.from({ length: 200 }, (_, i) => `w${i}`);
    for (const [i, n] of names.entries()) ix.apply(n, [stored([1, 2, 3], null, prompt.slice(0, 2 * (1 + (i % 3))))]);
    const many = ix.match(promptKeys(prompt, BS), names, 0);
    expect(names.map((n) => many.get(n)?.blocks)).toEqual(names.map((_, i) => 1 + (i % 3)));
    expectConsistent(ix);
  });
});
