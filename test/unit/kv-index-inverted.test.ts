// The block index's inverted side (first block -> holders, for stored and
// speculative entries) against a brute-force recomputation from the
// workers' own maps, after every step of random event sequences: stores
// (chained, tokenless, CPU tier), removals, clears, workers dropped and
// restarted, speculative entries, and the bounds' evictions of both. The
// decision's matches are checked against the per-worker walk they replace.
// And the whole index against a reference model kept in plain Maps (the
// structure the index had before its typed-array maps): the same blocks,
// speculative entries and their order (what the bounds evict next), the
// same counts and matches after every step.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import type { KvEvent } from '../../lib/serving/kv-index/decode';
import { KvBlockIndex, blockKey, promptKeys, rootKey } from '../../lib/serving/kv-index/index';

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

/** The events of an event step, for the index and the reference alike. */
function eventsOf(s: Step): KvEvent[] {
  if (s.op === 'store') return [stored(s.hashes, s.parent, s.tokens, s.cpu ? 'CPU' : 'GPU')];
  if (s.op === 'tokenless') {
    const e: KvEvent = {
      type: 'BlockStored',
      blockHashes: s.hashes.map(BigInt),
      parent: null,
      tokenIds: [],
      blockSize: 0,
      medium: 'GPU',
      loraName: null,
    };
    return [e];
  }
  if (s.op === 'remove') return [{ type: 'BlockRemoved', blockHashes: s.hashes.map(BigInt), medium: null }];
  if (s.op === 'clear') return [{ type: 'AllBlocksCleared' }];
  if (s.op === 'restart') return [{ type: 'AllBlocksCleared' }, stored([1, 2, 3, 4, 5], null, s.tokens)];
  return [];
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

/** Plain-Map trim: the oldest go, towards a tenth below the cap, at most 128 more than the cap requires. */
function refTrim<K, V>(m: Map<K, V>, cap: number): [K, V][] {
  const gone: [K, V][] = [];
  if (m.size <= cap) return gone;
  let n = Math.max(m.size - cap, Math.min(m.size - Math.floor(cap * 0.9), 128));
  for (const e of m) {
    if (n-- <= 0) break;
    m.delete(e[0]);
    gone.push(e);
  }
  return gone;
}

interface RefWorker {
  keys: Map<number, number>;
  engine: Map<bigint, number>;
  spec: Map<number, number>;
  specFirst: Map<number, number>;
}

/** The index's rules in plain Maps, with no inverted side: the reference the index must equal. */
class RefIndex {
  readonly workers = new Map<string, RefWorker>();
  constructor(readonly o: { maxBlocksPerWorker: number; maxWorkers: number; maxSpeculative: number; ttl: number }) {}

  #worker(name: string): RefWorker | undefined {
    let w = this.workers.get(name);
    if (!w && this.workers.size < this.o.maxWorkers) {
      w = { keys: new Map(), engine: new Map(), spec: new Map(), specFirst: new Map() };
      this.workers.set(name, w);
    }
    return w;
  }

  #hold(w: RefWorker, key: number, code: number, first: number): void {
    const had = w.keys.get(slotOf(key));
    const same = had !== undefined && had >>> 3 === highOf(key);
    const f = same ? had & 4 : first;
    w.keys.delete(slotOf(key));
    w.keys.set(slotOf(key), highOf(key) * 8 + f + (same ? Math.min(had & 3, code) : code));
  }

  apply(name: string, events: KvEvent[]): Record<string, number> {
    const counts: Record<string, number> = {};
    const bump = (k: string, n = 1) => {
      counts[k] = (counts[k] ?? 0) + n;
    };
    for (const e of events) {
      if (e.type === 'AllBlocksCleared') {
        this.workers.delete(name);
        bump('applied');
        continue;
      }
      const w = this.#worker(name);
      if (!w) {
        bump('too_many_workers');
        continue;
      }
      if (e.type === 'BlockRemoved') {
        for (const h of e.blockHashes) {
          const key = w.engine.get(h);
          if (key === undefined) bump('unknown_block');
          else {
            w.engine.delete(h);
            const v = w.keys.get(slotOf(key));
            if (v !== undefined && v >>> 3 === highOf(key)) w.keys.delete(slotOf(key));
          }
        }
        bump('applied');
        continue;
      }
      const code = e.medium === 'CPU' ? 1 : 0;
      if (e.tokenIds.length === 0) {
        for (const h of e.blockHashes) {
          const key = w.engine.get(h);
          if (key === undefined) bump('unknown_block');
          else this.#hold(w, key, code, 0);
        }
        bump('applied');
        continue;
      }
      let parent = e.parent === null ? rootKey(null) : w.engine.get(e.parent);
      if (parent === undefined) {
        bump('unknown_parent');
        continue;
      }
      for (let i = 0; i < e.blockHashes.length; i++) {
        parent = blockKey(parent, e.tokenIds, i * e.blockSize, (i + 1) * e.blockSize);
        w.engine.set(e.blockHashes[i], parent);
        const first = i === 0 && e.parent === null;
        this.#hold(w, parent, code, first ? 4 : 0);
        (first ? w.specFirst : w.spec).delete(slotOf(parent));
      }
      refTrim(w.keys, this.o.maxBlocksPerWorker);
      refTrim(w.engine, this.o.maxBlocksPerWorker);
      bump('applied');
      bump('blocks', e.blockHashes.length);
    }
    return counts;
  }

  speculate(name: string, keys: number[], now: number): void {
    const w = this.#worker(name);
    if (!w) return;
    const until = Math.max(0, Math.min(0x7fffffff, Math.ceil((now + this.o.ttl) / 100)));
    const held = (k: number) => {
      const v = w.keys.get(slotOf(k));
      return v !== undefined && v >>> 3 === highOf(k);
    };
    keys.forEach((k, j) => {
      if (!held(k)) (j === 0 ? w.specFirst : w.spec).set(slotOf(k), until);
    });
    refTrim(w.spec, this.o.maxSpeculative);
    refTrim(w.specFirst, this.o.maxSpeculative);
  }
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

  it('equals a plain-Map reference model after every step: blocks, speculative entries, their order, counts, matches', () => {
    const o = { maxBlocksPerWorker: 6, maxWorkers: 3, maxSpeculative: 2, ttl: 1000 };
    fc.assert(
      fc.property(fc.array(step, { minLength: 1, maxLength: 100 }), (steps) => {
        const ix = new KvBlockIndex({ ...o, speculativeTtlMs: o.ttl });
        const ref = new RefIndex(o);
        for (const s of steps) {
          const name = WORKERS[s.w as number];
          if (s.op === 'store' || s.op === 'tokenless' || s.op === 'remove' || s.op === 'clear' || s.op === 'restart') {
            const evs = eventsOf(s);
            expect(ix.apply(name, evs)).toEqual(ref.apply(name, evs));
          } else if (s.op === 'drop') {
            ix.drop(name);
            ref.workers.delete(name);
          } else if (s.op === 'speculate') {
            ix.speculate(name, promptKeys(s.tokens, BS), s.at);
            ref.speculate(name, promptKeys(s.tokens, BS), s.at);
          }
          const v = ix.views().workers;
          expect([...v.keys()].sort()).toEqual([...ref.workers.keys()].sort());
          for (const [n, x] of ref.workers) {
            const got = v.get(n);
            expect(got?.keys).toEqual([...x.keys]);
            expect(got?.spec).toEqual([...x.spec]);
            expect(got?.specFirst).toEqual([...x.specFirst]);
          }
          if (s.op === 'match') {
            const keys = promptKeys(s.tokens, BS);
            const got = ix.match(keys, WORKERS, s.at);
            for (const n of WORKERS) {
              const x = ref.workers.get(n);
              let blocks = 0;
              let weight = 0;
              for (const k of keys) {
                const val = x?.keys.get(slotOf(k));
                const sp = (blocks === 0 ? x?.specFirst : x?.spec)?.get(slotOf(k));
                if (val !== undefined && val >>> 3 === highOf(k)) weight += [1, 0.8, 0.5][val & 3];
                else if (sp !== undefined && sp > s.at / 100) weight += 1;
                else break;
                blocks++;
              }
              expect(got.get(n)?.blocks).toBe(blocks);
              expect(got.get(n)?.weight).toBeCloseTo(weight, 9);
            }
          }
        }
      }),
      { seed: 47, numRuns: 400 },
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
