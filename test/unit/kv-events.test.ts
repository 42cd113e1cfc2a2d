// vLLM's KV events on the publisher side: the sha256_cbor chain against the
// spec's test vectors (docs: shared spec §4.3), the msgpack of a batch
// against its worked example (§8, with the fields vLLM leaves at their
// defaults omitted), vLLM's config defaults and bind rule, and what the
// announcer emits as holders take and let go of prefixes.
import { describe, expect, it } from 'vitest';
import { BlockAnnouncer } from '../../lib/serving/worker/kv-events/announcer';
import {
  blockDigests,
  canonicalCbor,
  noneHash,
  sha256Cbor,
  wireHash,
} from '../../lib/serving/worker/kv-events/block-hash';
import { bindsEndpoint, parseKvEventsConfig } from '../../lib/serving/worker/kv-events/config';
import { type KvEvent, encodeBatch } from '../../lib/serving/worker/kv-events/encode';
import { SyntheticPrefixCache } from '../../lib/serving/models/synthetic-cache';

const range = (a: number, b: number) => Array.from({ length: b - a + 1 }, (_, i) => a + i);
const hex = (s: string) => Buffer.from(s.replace(/\s+/g, ''), 'hex');
const str = (s: string) => Buffer.from(s).toString('hex');

describe('sha256_cbor block hashes (spec §4.3 vectors)', () => {
  it('hashes the seed and the first two blocks as vLLM does', () => {
    expect(canonicalCbor('vllm-none-hash').toString('hex')).toBe('6e766c6c6d2d6e6f6e652d68617368');
    expect(noneHash().toString('hex')).toBe('9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0');
    expect(noneHash('0').toString('hex')).toBe('4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e');
    const cbor = canonicalCbor([noneHash(), range(1, 16), null]);
    expect(cbor.subarray(0, 3).toString('hex')).toBe('835820');
    expect(cbor.subarray(35, 38).toString('hex')).toBe('900102');
    expect(cbor.at(-1)).toBe(0xf6);
    const [h1, h2] = blockDigests(range(1, 40), 16, noneHash());
    expect(blockDigests(range(1, 40), 16, noneHash())).toHaveLength(2); // the partial third block is not hashed
    expect(h1.toString('hex')).toMatch(/^cd7c51bc.*7fd01682$/);
    expect(wireHash(h1)).toBe(8866452693264111234n);
    expect(wireHash(h2)).toBe(807986237951177663n);
    expect(h2.equals(sha256Cbor([h1, range(17, 32), null]))).toBe(true);
  });

  it('encodes CBOR heads at every width, and refuses what it cannot encode', () => {
    expect(canonicalCbor([23, 24, 255, 256, 65536, 2 ** 32, -1, -25]).toString('hex')).toBe(
      '88' + '17' + '1818' + '18ff' + '190100' + '1a00010000' + '1b0000000100000000' + '20' + '3818',
    );
    expect(() => canonicalCbor(1.5)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
  });
});

describe('EventBatch msgpack (spec §8)', () => {
  const stored: KvEvent = {
    type: 'BlockStored',
    blockHashes: [8866452693264111234n, 807986237951177663n],
    parentBlockHash: null,
    tokenIds: range(1, 32),
    blockSize: 16,
  };

  it('encodes a map-encoded BlockStored batch byte for byte', () => {
    const want = hex(`93 cb 41daa8dbe0200000 91 88
      a4 ${str('type')} ab ${str('BlockStored')}
      ac ${str('block_hashes')} 92 cf 7b0bf7bf7fd01682 cf 0b368b33d87bf3bf
      b1 ${str('parent_block_hash')} c0
      a9 ${str('token_ids')} dc 0020 ${Buffer.from(range(1, 32)).toString('hex')}
      aa ${str('block_size')} 10
      a7 ${str('lora_id')} c0
      a6 ${str('medium')} a3 ${str('GPU')}
      a9 ${str('lora_name')} c0
      00`);
    expect(encodeBatch([stored], { ts: 1789095808.5 }).toString('hex')).toBe(want.toString('hex'));
  });

  it('encodes removals, clears and the positional form', () => {
    const removed = encodeBatch([{ type: 'BlockRemoved', blockHashes: [807986237951177663n] }], { ts: 0 });
    expect(removed.subarray(10).toString('hex')).toBe(
      `9183${'a4'}${str('type')}ac${str('BlockRemoved')}ac${str('block_hashes')}91cf0b368b33d87bf3bfa6${str('medium')}a3${str('GPU')}00`,
    );
    const cleared = encodeBatch([{ type: 'AllBlocksCleared' }], { ts: 0 });
    expect(cleared.subarray(11, -1).toString('hex')).toBe(`81a4${str('type')}b0${str('AllBlocksCleared')}`);
    const one = { ...stored, blockHashes: [8866452693264111234n], tokenIds: range(1, 16) };
    const positional = encodeBatch([one], { ts: 0, encoding: 'array' });
    expect(positional.subarray(11, -1).toString('hex')).toBe(
      `98ab${str('BlockStored')}91cf7b0bf7bf7fd01682c0dc0010${Buffer.from(range(1, 16)).toString('hex')}10c0a3${str('GPU')}c0`,
    );
    // Hashes at or past 2^63 stay uint64, never a float.
    const big = encodeBatch([{ type: 'BlockRemoved', blockHashes: [2n ** 64n - 1n] }], { ts: 0 });
    expect(big.toString('hex')).toContain('91cfffffffffffffffff');
  });
});

describe('--kv-events-config', () => {
  it("fills vLLM's defaults", () => {
    expect(parseKvEventsConfig(undefined)).toMatchObject({ enabled: false, publisher: 'null' });
    expect(parseKvEventsConfig('{"enable_kv_cache_events":true}')).toEqual({
      enabled: true,
      publisher: 'zmq',
      endpoint: 'tcp://*:5557',
      replayEndpoint: null,
      bufferSteps: 10_000,
      hwm: 100_000,
      maxQueueSize: 100_000,
      topic: '',
      encoding: 'map',
      hashSeed: 'vllm-none-hash',
    });
  });

  it('binds where vLLM binds, connects elsewhere', () => {
    for (const a of ['tcp://*:5557', 'tcp://[::]:5557', 'ipc:///tmp/x', 'inproc://x'])
      expect(bindsEndpoint(a)).toBe(true);
    for (const a of ['tcp://127.0.0.1:5557', 'tcp://collector:5557']) expect(bindsEndpoint(a)).toBe(false);
  });

  it('refuses bad configs with a code', () => {
    for (const bad of [
      'not json',
      '[]',
      '{"enable_kv_cache_events":"yes"}',
      '{"publisher":"kafka"}',
      '{"buffer_steps":0}',
      '{"hwm":-1}',
      '{"endpoint":"http://x"}',
      '{"replay_endpoint":""}',
      '{"encoding":"json"}',
      '{"topik":"x"}',
    ])
      expect(() => parseKvEventsConfig(bad), bad).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
  });
});

describe('BlockAnnouncer', () => {
  function announcer(blockSize = 4) {
    const events: KvEvent[] = [];
    return { a: new BlockAnnouncer(blockSize, 'vllm-none-hash', (e) => events.push(e)), events };
  }
  const wire = (tokens: number[], bs = 4) => blockDigests(tokens, bs, noneHash()).map(wireHash);

  it('announces each block once while any holder holds it, with its parent and tokens', () => {
    const { a, events } = announcer();
    const p1 = range(1, 10); // 2 full blocks
    const p2 = [...range(1, 8), ...range(50, 57)]; // shares 2 blocks, adds 2
    a.hold('x', p1);
    a.hold('y', p2);
    const w2 = wire(p2);
    expect(events).toEqual([
      { type: 'BlockStored', blockHashes: wire(p1), parentBlockHash: null, tokenIds: range(1, 8), blockSize: 4 },
      { type: 'BlockStored', blockHashes: w2.slice(2), parentBlockHash: w2[1], tokenIds: range(50, 57), blockSize: 4 },
    ]);
    expect(a.cachedTokens([...range(1, 8), 50, 51, 52, 53, 99])).toBe(12);
    events.length = 0;
    a.drop('x');
    expect(events).toEqual([]); // y still holds them
    a.drop('y');
    expect(events).toEqual([{ type: 'BlockRemoved', blockHashes: [...w2].reverse() }]);
    a.drop('y'); // nothing left: no removal of a block not announced
    expect(events).toHaveLength(1);
    expect(a.size).toBe(0);
  });

  it('a holder that takes a longer prefix announces only the new blocks', () => {
    const { a, events } = announcer();
    a.hold('c', range(1, 4));
    a.hold('c', range(1, 12));
    const w = wire(range(1, 12));
    expect(events[1]).toEqual({
      type: 'BlockStored',
      blockHashes: w.slice(1),
      parentBlockHash: w[0],
      tokenIds: range(5, 12),
      blockSize: 4,
    });
    a.hold('c', range(1, 4));
    expect(events[2]).toEqual({ type: 'BlockRemoved', blockHashes: [w[2], w[1]] });
  });

  it('the synthetic cache evicts its oldest prompts past its capacity, and reports its hits', () => {
    const { a, events } = announcer();
    const cache = new SyntheticPrefixCache(a, 4, 4);
    expect(cache.prefill(range(1, 8))).toBe(0);
    expect(cache.prefill(range(1, 9))).toBe(8); // the same two blocks, a partial third
    expect(cache.prefill(range(101, 108))).toBe(0); // 4 blocks held: at capacity
    expect(events.filter((e) => e.type === 'BlockRemoved')).toEqual([]);
    expect(cache.prefill(range(201, 204))).toBe(0); // 5 > 4: the oldest prompt goes
    expect(events.at(-1)).toEqual({ type: 'BlockRemoved', blockHashes: wire(range(1, 8)).reverse() });
    expect(a.size).toBe(3);
  });
});
