// The block index's typed-array maps against JavaScript's Map, which they
// replace, over random operation sequences: the same entries, values and
// insertion order after every step (a set keeps an entry's age, setYoungest
// is a delete then a set, trimming takes the oldest), through growth and the
// reuse of freed records; engine hashes whose low or high halves collide
// stay apart.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { EngineMap } from '../../lib/serving/kv-index/engine-map';
import { Holders } from '../../lib/serving/kv-index/holders';
import { OrderedIntMap } from '../../lib/serving/kv-index/ordered-map';
import { trimOrdered } from '../../lib/serving/kv-index/trim';

type IntOp = { op: 'set' | 'young'; k: number; v: number } | { op: 'delete'; k: number } | { op: 'trim'; cap: number };

// A few keys (so that they recur) spread over int32, the negative half included.
const key = fc.constantFrom(0, 1, -1, 7, 0x7fffffff, -0x80000000, 12345, -777, 99, 100, 101, 4242);
const intOp: fc.Arbitrary<IntOp> = fc.oneof(
  { weight: 5, arbitrary: fc.record({ op: fc.constant('set' as const), k: key, v: fc.nat() }) },
  { weight: 3, arbitrary: fc.record({ op: fc.constant('young' as const), k: key, v: fc.nat() }) },
  { weight: 3, arbitrary: fc.record({ op: fc.constant('delete' as const), k: key }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant('trim' as const), cap: fc.nat(6) }) },
);

/** The reference: a Map trimmed as the index trimmed its Maps (the oldest first, 'excess' of them). */
function refTrim(m: Map<number, number>, cap: number): number[] {
  const gone: number[] = [];
  if (m.size <= cap) return gone;
  let n = Math.max(m.size - cap, Math.min(m.size - Math.floor(cap * 0.9), 128));
  for (const k of m.keys()) {
    if (n-- <= 0) break;
    m.delete(k);
    gone.push(k);
  }
  return gone;
}

describe('OrderedIntMap', () => {
  it('equals a Map after every step of random sets, moves, deletes and trims (fixed seed)', () => {
    fc.assert(
      fc.property(fc.array(intOp, { maxLength: 200 }), (ops) => {
        const m = new OrderedIntMap();
        const ref = new Map<number, number>();
        // Trimming also forgets the inverted side's records of what goes.
        const holders = new Holders();
        for (const o of ops) {
          if (o.op === 'set') {
            m.set(o.k, o.v);
            ref.set(o.k, o.v);
          } else if (o.op === 'young') {
            m.setYoungest(o.k, o.v);
            ref.delete(o.k);
            ref.set(o.k, o.v);
          } else if (o.op === 'delete') expect(m.delete(o.k)).toBe(ref.delete(o.k));
          else {
            for (const k of ref.keys()) holders.set(k, 3, 1);
            const gone = refTrim(ref, o.cap);
            trimOrdered(m, o.cap, holders, 3);
            for (const k of gone) expect(holders.map.has(k)).toBe(false);
            for (const k of ref.keys()) holders.delete(k, 3);
            expect(holders.size).toBe(0);
          }
          expect(m.size).toBe(ref.size);
          expect([...m.entries()]).toEqual([...ref.entries()]);
          for (const k of [0, 1, -1, 99, 4242]) expect(m.get(k)).toBe(ref.get(k) ?? -1);
        }
      }),
      { seed: 46, numRuns: 300 },
    );
  });

  it('lays its ring out again when records deleted out of order fill it, keeping order', () => {
    const m = new OrderedIntMap(8);
    const ref = new Map<number, number>();
    const set = (k: number) => {
      m.set(k, k);
      ref.set(k, k);
    };
    for (let k = 0; k < 8; k++) set(k);
    for (const k of [1, 3, 5, 6]) {
      m.delete(k);
      ref.delete(k);
    }
    // The ring is full of live and dead records: these appends lay it out again, without the dead.
    for (let k = 10; k < 14; k++) set(k);
    m.setYoungest(0, 0);
    ref.delete(0);
    ref.set(0, 0);
    expect([...m.entries()]).toEqual([...ref.entries()]);
    for (let k = 0; k < 14; k++) expect(m.get(k)).toBe(ref.get(k) ?? -1);
  });

  it('stays within four records a live entry under churn (dead records do not grow the ring)', () => {
    const m = new OrderedIntMap();
    let x = 1;
    for (let i = 0; i < 100_000; i++) {
      x = Math.imul(x ^ (x >>> 15), 0x2c1b3c6d) + i;
      // 100 keys at most: moved to the young end, set in place, deleted out of order, trimmed.
      const k = (x >>> 0) % 100;
      if (i % 4 === 0) m.delete(k);
      else if (i % 4 === 1) m.set(k, i);
      else m.setYoungest(k, i);
      if (i % 1000 === 0) trimOrdered(m, 50);
      expect(m.capacity).toBeLessThanOrEqual(Math.max(8, 4 * 100));
    }
  });

  it('grows past its first capacity and reuses freed records, keeping order', () => {
    const m = new OrderedIntMap();
    const ref = new Map<number, number>();
    for (let i = 0; i < 5000; i++) {
      const k = Math.imul(i, 0x9e3779b1);
      m.set(k, i);
      ref.set(k, i);
      if (i % 3 === 0) {
        const old = ref.keys().next().value as number;
        m.delete(old);
        ref.delete(old);
      }
    }
    expect([...m.entries()]).toEqual([...ref.entries()]);
    // Trimmed down to a few, the youngest are left, in order.
    const keep = [...ref.entries()].slice(-5);
    trimOrdered(m, 5);
    expect([...m.entries()]).toEqual(keep);
  });
});

describe('EngineMap', () => {
  // Hashes whose halves collide: the same low 32 bits with other high ones, and the other way round.
  const hash = fc.constantFrom(
    0n,
    1n,
    0x1_0000_0001n,
    0x2_0000_0001n,
    0xffff_ffff_0000_0001n,
    0xffff_ffff_ffff_ffffn,
    0x8000_0000_0000_0000n,
    0x0000_0001_ffff_ffffn,
    42n,
    0xdead_beef_0000_002an,
  );
  const ownKey = fc.integer({ min: 0, max: Number.MAX_SAFE_INTEGER });
  type Op = { op: 'set'; h: bigint; k: number } | { op: 'delete'; h: bigint } | { op: 'drop'; n: number };
  const op: fc.Arbitrary<Op> = fc.oneof(
    { weight: 5, arbitrary: fc.record({ op: fc.constant('set' as const), h: hash, k: ownKey }) },
    { weight: 3, arbitrary: fc.record({ op: fc.constant('delete' as const), h: hash }) },
    { weight: 1, arbitrary: fc.record({ op: fc.constant('drop' as const), n: fc.nat(4) }) },
  );

  it('equals a Map<bigint, number> after every step (fixed seed)', () => {
    fc.assert(
      fc.property(fc.array(op, { maxLength: 200 }), (ops) => {
        const m = new EngineMap();
        const ref = new Map<bigint, number>();
        for (const o of ops) {
          if (o.op === 'set') {
            m.set(o.h, o.k);
            ref.set(o.h, o.k);
          } else if (o.op === 'delete') expect(m.delete(o.h)).toBe(ref.delete(o.h));
          else {
            m.dropOldest(o.n);
            for (const h of [...ref.keys()].slice(0, o.n)) ref.delete(h);
          }
          expect(m.size).toBe(ref.size);
          for (const h of [0n, 1n, 0x1_0000_0001n, 0x2_0000_0001n, 0xffff_ffff_ffff_ffffn, 0xdead_beef_0000_002an])
            expect(m.get(h)).toBe(ref.get(h) ?? -1);
        }
        // Order: dropping all but the youngest keeps what the Map's last entry is.
        if (ref.size > 0) {
          const [h, k] = [...ref.entries()][ref.size - 1];
          m.dropOldest(ref.size - 1);
          expect(m.size).toBe(1);
          expect(m.get(h)).toBe(k);
        }
      }),
      { seed: 46, numRuns: 300 },
    );
  });

  it('keeps hashes apart that share a half (some share a bucket too)', () => {
    const m = new EngineMap();
    const hs: bigint[] = [];
    for (let i = 0n; i < 64n; i++) hs.push((i << 32n) | 1n, (7n << 32n) | (i + 100n));
    for (const [i, h] of hs.entries()) m.set(h, i);
    for (const [i, h] of hs.entries()) expect(m.get(h)).toBe(i);
    for (let i = 0; i < hs.length; i += 2) expect(m.delete(hs[i])).toBe(true);
    for (const [i, h] of hs.entries()) expect(m.get(h)).toBe(i % 2 ? i : -1);
  });

  it('holds many hashes through growth', () => {
    const m = new EngineMap();
    for (let i = 0n; i < 3000n; i++) m.set((i << 40n) | (i * 7n), Number(i) * 1_000_003);
    for (let i = 0n; i < 3000n; i += 7n) expect(m.get((i << 40n) | (i * 7n))).toBe(Number(i) * 1_000_003);
    expect(m.get(1n << 63n)).toBe(-1);
  });
});
