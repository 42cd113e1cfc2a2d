// Workers whose block size is a multiple of the index's key size: each
// block is several keys of the one chain (so a prompt is keyed once), its
// removal and its tokenless (offload) stores reach all of them through the
// engine map's parts, its match is floored to whole blocks of its own, and
// bounds and hostile sizes hold. The proxy's block size when not given: the
// greatest common divisor of what it sees, down to 16.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { KeySize } from '../../lib/serving/kv-index/block-size';
import type { KvEvent } from '../../lib/serving/kv-index/decode';
import { KvBlockIndex, promptKeys } from '../../lib/serving/kv-index/index';
import { PreciseRouting } from '../../lib/serving/kv-index/precise';
import { encodeBatch } from '../../lib/serving/worker/kv-events/encode';

const toks = (n: number, base = 0) => Array.from({ length: n }, (_, i) => (base + i) % 251);
const stored = (hashes: bigint[], parent: bigint | null, tokenIds: number[], blockSize: number, medium = 'GPU') =>
  ({ type: 'BlockStored', blockHashes: hashes, parent, tokenIds, blockSize, medium, loraName: null }) as KvEvent;
const removed = (hashes: bigint[]): KvEvent => ({ type: 'BlockRemoved', blockHashes: hashes, medium: 'GPU' });

describe('KvBlockIndex with blocks of several keys', () => {
  it('keys a 16-token block as 4 keys of 4, removes and re-tiers all 4, floors the match to whole blocks', () => {
    const ix = new KvBlockIndex({}, 4);
    const p = toks(40);
    ix.apply('w16', [stored([1n, 2n], null, p.slice(0, 32), 16)]);
    ix.apply('w4', [stored([1n, 2n, 3n, 4n, 5n, 6n], null, p.slice(0, 24), 4)]);
    expect(ix.size).toBe(8 + 6);
    const keys = promptKeys(p, 4); // 10 keys
    let m = ix.match(keys, ['w16', 'w4']);
    expect(m.get('w16')).toEqual({ blocks: 8, weight: 8 });
    expect(m.get('w4')).toEqual({ blocks: 6, weight: 6 });
    // 28 tokens in common: the 16-worker holds 7 of its keys but reuses one block (4 keys).
    const q = [...p.slice(0, 28), 250, 250, 250, 250];
    m = ix.match(promptKeys(q, 4), ['w16', 'w4']);
    expect(m.get('w16')).toEqual({ blocks: 4, weight: 4 });
    expect(m.get('w4')?.blocks).toBe(6);
    // Offloaded to CPU, tokenless: all four keys of block 2 take the tier (1 + 4 x 0.8 when GPU lets go).
    ix.apply('w16', [stored([2n], null, [], 0, 'CPU')]);
    expect(ix.match(keys, ['w16']).get('w16')?.weight).toBeCloseTo(8);
    // The removal of block 1 takes its 4 keys, the whole run with them.
    expect(ix.apply('w16', [removed([1n])]).unknown_block).toBeUndefined();
    expect(ix.size).toBe(4 + 6);
    expect(ix.match(keys, ['w16']).get('w16')?.blocks).toBe(0);
    ix.apply('w16', [removed([2n])]);
    expect(ix.views().workers.get('w16')?.keys).toEqual([]);
  });

  it('chains a later store on its parent block, and a block size that is no multiple is dropped and counted', () => {
    const ix = new KvBlockIndex({}, 4);
    const p = toks(48);
    ix.apply('w', [stored([7n], null, p.slice(0, 16), 16)]);
    ix.apply('w', [stored([8n], 7n, p.slice(16, 32), 16)]);
    // A different block size from the same worker: its tokens are chunked by its own (12 = 3 keys), chained on.
    ix.apply('w', [stored([9n], 8n, p.slice(32, 44), 12)]);
    expect(ix.match(promptKeys(p, 4), ['w']).get('w')?.blocks).toBe(9); // floored to its latest block size
    expect(ix.apply('w', [stored([10n], null, toks(6), 6)])).toEqual({ block_size: 1 });
    expect(ix.apply('w', [stored([11n], null, toks(2), 2)])).toEqual({ block_size: 1 });
    expect(ix.size).toBe(11);
  });

  it('stays within its bounds: keys and engine entries a worker, keys an event', () => {
    const ix = new KvBlockIndex({ maxBlocksPerWorker: 100, maxKeysPerEvent: 64 }, 2);
    // 40 blocks of 8 keys at a bound of 100 keys, then stored again in another order (as a publisher
    // announces a block again), some with parts the bound took: the index stays within it throughout.
    const block = (i: number) => stored([BigInt(1000 + i)], null, toks(16, i * 5), 16);
    for (let i = 0; i < 40; i++) ix.apply('w', [block(i)]);
    expect(ix.size).toBeLessThanOrEqual(100);
    for (let round = 0; round < 3; round++)
      for (let i = 0; i < 40; i++) {
        ix.apply('w', [block((i * 7 + round * 13) % 40)]);
        expect(ix.size).toBeLessThanOrEqual(100);
      }
    // Removing them all leaves nothing behind: no key of a block outlives its removal.
    for (let i = 0; i < 40; i++) ix.apply('w', [removed([BigInt(1000 + i)])]);
    expect(ix.size).toBe(0);
    // A block stored again is young again in both maps: the bound then takes the same blocks' keys and entries.
    const small = new KvBlockIndex({ maxBlocksPerWorker: 16 }, 2);
    for (const i of [0, 1, 0, 2]) small.apply('w', [block(i)]);
    small.apply('w', [removed([1000n])]);
    expect(
      small
        .views()
        .workers.get('w')
        ?.keys.map(([slot]) => slot),
    ).toEqual(promptKeys(toks(16, 10), 2).map((k) => k | 0));
    // 9 hashes x 8 keys = 72 keys > 64: dropped whole.
    const big = stored(
      Array.from({ length: 9 }, (_, i) => BigInt(i + 1)),
      null,
      toks(144),
      16,
    );
    expect(ix.apply('w', [big])).toEqual({ too_large: 1 });
    expect(ix.size).toBe(0);
  });
});

describe('a worker at W = 4 x B keeps the keys a worker at B storing the same tokens keeps', () => {
  const PER = 4;
  const B = 2;
  // Each W-block hash h stands for the B-worker's hashes h * 8 + j.
  const sub = (h: number, j: number) => BigInt(h * 8 + j);
  const op = fc.oneof(
    fc.record({
      parent: fc.option(fc.nat(30), { nil: null }),
      hashes: fc.uniqueArray(fc.nat(30), { minLength: 1, maxLength: 3 }),
      tokens: fc.array(fc.nat(2), { minLength: 24, maxLength: 24 }),
    }),
    fc.record({ remove: fc.uniqueArray(fc.nat(30), { minLength: 1, maxLength: 3 }) }),
  );
  it('after every step of random stores and removals: the same keys, and a match floored to whole W-blocks', () => {
    fc.assert(
      fc.property(fc.array(op, { maxLength: 30 }), fc.array(fc.nat(2), { minLength: 40, maxLength: 40 }), (ops, q) => {
        const ix = new KvBlockIndex({}, B);
        for (const o of ops) {
          if ('remove' in o) {
            ix.apply('w', [removed(o.remove.map(BigInt))]);
            ix.apply('r', [removed(o.remove.flatMap((h) => [0, 1, 2, 3].map((j) => sub(h, j))))]);
          } else {
            const tokens = o.tokens.slice(0, o.hashes.length * PER * B);
            const p = o.parent === null ? null : BigInt(o.parent);
            ix.apply('w', [stored(o.hashes.map(BigInt), p, tokens, PER * B)]);
            const subs = o.hashes.flatMap((h) => [0, 1, 2, 3].map((j) => sub(h, j)));
            ix.apply('r', [stored(subs, o.parent === null ? null : sub(o.parent, PER - 1), tokens, B)]);
          }
          const v = ix.views().workers;
          const slots = (n: string) => new Set(v.get(n)?.keys.map(([slot]) => slot));
          expect(slots('w')).toEqual(slots('r'));
          const m = ix.match(promptKeys(q, B), ['w', 'r']);
          const r = m.get('r')?.blocks ?? 0;
          expect(m.get('w')?.blocks).toBe(r - (r % PER));
        }
      }),
      { seed: 46, numRuns: 300 },
    );
  });
});

describe("the proxy's block size", () => {
  it('given: follows multiples only, and says which size would follow the rest', () => {
    const k = new KeySize(16);
    expect(k.consider(512)).toEqual({ follow: true });
    const v = k.consider(24);
    expect(v.follow).toBe(false);
    expect(!v.follow && v.why).toMatch(/block_size 24 is not a multiple of the proxy's 16.*--kv-block-size 8/);
    expect(k.value).toBe(16);
  });

  it('not given: the first size, then the greatest common divisor down to 16, never below it by itself', () => {
    const k = new KeySize();
    expect(k.consider(512)).toEqual({ follow: true, adopt: 512 });
    expect(k.consider(1024)).toEqual({ follow: true });
    expect(k.consider(48)).toEqual({ follow: true, rekey: 16 });
    expect(k.consider(100).follow).toBe(false);
    expect(k.value).toBe(16);
    const small = new KeySize();
    small.consider(4);
    expect(small.consider(12)).toEqual({ follow: true });
  });

  it('a GGUF worker at 512 first, one at 16 later: the index is keyed by 16 and follows both', async () => {
    const r = new PreciseRouting({});
    const batch = (e: Parameters<typeof encodeBatch>[0]) => encodeBatch(e, { ts: 0 });
    const p = toks(600);
    const big = { type: 'BlockStored', blockHashes: [1n], parentBlockHash: null, tokenIds: p.slice(0, 512) } as const;
    r.applyPayload('gguf', batch([{ ...big, blockSize: 512 }]));
    expect(r.blockSize).toBe(512);
    expect(r.index.size).toBe(1);
    const small = { ...big, blockHashes: [5n, 6n], tokenIds: p.slice(0, 32), blockSize: 16 };
    r.applyPayload('vllm', batch([small]));
    // Keyed again: the index is cleared for the replays that rebuild it (none here: no subscriptions).
    expect(r.blockSize).toBe(16);
    expect(r.index.size).toBe(0);
    await new Promise((done) => setImmediate(done));
    r.applyPayload('gguf', batch([{ ...big, blockSize: 512 }]));
    r.applyPayload('vllm', batch([small]));
    expect(r.index.size).toBe(32 + 2);
    const m = r.index.match(promptKeys(p, 16), ['gguf', 'vllm']);
    expect(m.get('gguf')?.blocks).toBe(32);
    expect(m.get('vllm')?.blocks).toBe(2);
    r.close();
  });
});
