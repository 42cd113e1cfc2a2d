// The envelope around a llama sequence state in KV blocks: whatever arrives,
// the decode either gets the exact state the prefill wrapped for the request
// it was given or a KvRejected naming why, never an exception of another kind
// and never other bytes.
import { randomBytes } from 'node:crypto';
import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import {
  ENVELOPE_FIELDS,
  HEADER_BYTES,
  envelopeBytes,
  openEnvelope,
  resealEnvelope,
  stateHeader,
  tamperEnvelope,
  writeEnvelope,
} from '../../lib/serving/models/kv-state';
import { stateChecksumReady } from '../../lib/serving/models/state-checksum';
import type { KvRejected } from '../../lib/serving/models/types';
import { kvRejectedReason as reason } from '../helpers';
import { BIND, FP, envelopeOptions } from './kv-state-helpers';

const BLOCK = 256;

/** A llama.cpp-shaped sequence state: 'ggsq', version, n tokens, tokens, payload. */
function seqState(tokens: number, payload: number): Buffer {
  const b = Buffer.alloc(12 + 4 * tokens + payload);
  b.writeUInt32LE(0x67677371, 0);
  b.writeUInt32LE(3, 4);
  b.writeUInt32LE(tokens, 8);
  randomBytes(b.length - 12).copy(b, 12);
  return b;
}

function wrap(state: Buffer, tokens: number, next?: number, secret?: string, seed = 0, samplingKey = 0) {
  const n = Math.ceil(envelopeBytes(state.length) / BLOCK);
  const blocks = Array.from({ length: n + 2 }, () => Buffer.alloc(BLOCK));
  writeEnvelope(
    stateHeader(
      state,
      { promptTokens: tokens, fingerprint: FP, nextToken: next, seed, samplingKey, binding: BIND },
      secret,
    ),
    state,
    BLOCK,
    (i) => blocks[i],
  );
  return { blocks, n };
}

const opts = (n: number, secret?: string) => envelopeOptions(n, BLOCK, 1 << 20, secret);

beforeAll(() => stateChecksumReady());

/** The blocks as one buffer, and back. */
const joined = (blocks: Buffer[]) => Buffer.concat(blocks);
const split = (b: Buffer) => Array.from({ length: b.length / BLOCK }, (_, i) => b.subarray(i * BLOCK, (i + 1) * BLOCK));

describe('KV state envelope', () => {
  it('round-trips the state and its continuation (tokens held, next token, seed, sampling key), across blocks', () => {
    for (const [tokens, payload, next, seed, key] of [
      [1, 0, undefined, 0, 0],
      [5, 1000, 0, 7, 0xdeadbeef],
      [60, BLOCK * 3, 31999, 0xffffffff, 1],
    ] as const) {
      const state = seqState(tokens, payload);
      const { blocks, n } = wrap(state, tokens, next, undefined, seed, key);
      const got = openEnvelope((i) => blocks[i], opts(n));
      expect(got.state.equals(state)).toBe(true);
      expect(got.promptTokens).toBe(tokens);
      expect(got.nextToken).toBe(next);
      expect(got.seed).toBe(seed);
      expect(got.samplingKey).toBe(key);
    }
  });

  it.each([
    ['truncate', 'truncated'],
    ['corrupt', 'corrupted'],
    ['oversize', 'oversized'],
    ['foreign', 'foreign-model'],
  ] as const)('a %s state is refused as %s', (how, why) => {
    const state = seqState(40, 2000);
    const { blocks, n } = wrap(state, 40);
    tamperEnvelope((b) => blocks[b], n, BLOCK, how);
    expect(reason(() => openEnvelope((i) => blocks[i], opts(n)))).toBe(why);
  });

  it('fewer blocks than the state, another model, more tokens than the context: refused', () => {
    const state = seqState(40, 2000);
    const { blocks, n } = wrap(state, 40);
    expect(reason(() => openEnvelope((i) => blocks[i], opts(n - 1)))).toBe('truncated');
    expect(reason(() => openEnvelope((i) => blocks[i], { ...opts(n), fingerprint: Buffer.alloc(32) }))).toBe(
      'foreign-model',
    );
    expect(reason(() => openEnvelope((i) => blocks[i], { ...opts(n), maxTokens: 39 }))).toBe('oversized');
    expect(reason(() => openEnvelope((i) => blocks[i], { ...opts(n), maxStateBytes: 100 }))).toBe('oversized');
    expect(reason(() => openEnvelope((i) => blocks[i], opts(0)))).toBe('truncated');
  });

  it('a state made for another request (engine, request id or block ids) is refused as wrong-request', () => {
    const state = seqState(40, 100);
    const { blocks, n } = wrap(state, 40);
    for (const binding of [
      { ...BIND, engineId: 'prefill-2' },
      { ...BIND, requestId: 'kv-2-abc' },
      { ...BIND, blockIds: [4, 5, 7] },
      { ...BIND, blockIds: [4, 5] },
    ])
      expect(reason(() => openEnvelope((i) => blocks[i], { ...opts(n), binding }))).toBe('wrong-request');
  });

  it('with a KV secret: only an HMAC with that secret opens; a checksum anyone can recompute does not', () => {
    const state = seqState(40, 1000);
    const signed = wrap(state, 40, 7, 's3cret');
    expect(openEnvelope((i) => signed.blocks[i], opts(signed.n, 's3cret')).state.equals(state)).toBe(true);
    expect(reason(() => openEnvelope((i) => signed.blocks[i], opts(signed.n, 'other')))).toBe('unauthenticated');
    expect(reason(() => openEnvelope((i) => signed.blocks[i], opts(signed.n)))).toBe('unauthenticated');
    const plain = wrap(state, 40, 7);
    expect(reason(() => openEnvelope((i) => plain.blocks[i], opts(plain.n, 's3cret')))).toBe('unauthenticated');
    // Altered and sealed again without the secret (the flag set, as an attacker would): refused.
    const forged = Buffer.concat(signed.blocks);
    forged.writeUInt32LE(8 + 1, HEADER_BYTES + 12 + 4);
    resealEnvelope(forged);
    forged.writeUInt32LE(1, 8);
    const fb = Array.from({ length: signed.blocks.length }, (_, i) => forged.subarray(i * BLOCK, (i + 1) * BLOCK));
    expect(reason(() => openEnvelope((i) => fb[i], opts(signed.n, 's3cret')))).toBe('unauthenticated');
  });

  it('without a secret the MAC is an XXH64 checksum (flag 2, 8 bytes, then 0s); any change to it or its tail is refused', () => {
    const state = seqState(40, 3000);
    const { blocks, n } = wrap(state, 40);
    expect(blocks[0].readUInt32LE(8)).toBe(2);
    expect(blocks[0].subarray(232, 256).every((x) => x === 0)).toBe(true);
    expect(blocks[0].subarray(224, 232).some((x) => x !== 0)).toBe(true);
    for (const at of [224, 231, 232, 255]) {
      const b = split(joined(blocks));
      b[0][at] ^= 1;
      expect(reason(() => openEnvelope((i) => b[i], opts(n)))).toBe('corrupted');
    }
  });

  it("an earlier prefill's SHA-256 checksum (flags 0) still opens, and still catches damage", () => {
    const state = seqState(40, 3000);
    const env = joined(wrap(state, 40, 9).blocks);
    env.writeUInt32LE(0, 8);
    resealEnvelope(env);
    expect(env.subarray(232, 256).some((x) => x !== 0)).toBe(true); // a whole SHA-256, not XXH64's 8 bytes
    const n = Math.ceil(envelopeBytes(state.length) / BLOCK);
    const got = openEnvelope((i) => split(env)[i], opts(n));
    expect(got.state.equals(state)).toBe(true);
    expect(got.nextToken).toBe(9);
    env[HEADER_BYTES + 1500] ^= 4;
    expect(reason(() => openEnvelope((i) => split(env)[i], opts(n)))).toBe('corrupted');
  });

  it('flags naming both an HMAC and a checksum, or an unknown bit, are malformed', () => {
    const state = seqState(4, 10);
    for (const flags of [3, 4, 0x80000002]) {
      const env = joined(wrap(state, 4).blocks);
      env.writeUInt32LE(flags, 8);
      resealEnvelope(env);
      const n = Math.ceil(envelopeBytes(state.length) / BLOCK);
      expect(reason(() => openEnvelope((i) => split(env)[i], opts(n)))).toBe('malformed');
      expect(reason(() => openEnvelope((i) => split(env)[i], opts(n, 'k')))).not.toBe('accepted');
    }
  });

  it('another envelope version is refused as version (NIXL_ERR_NOT_SUPPORTED)', () => {
    const state = seqState(4, 10);
    const { blocks, n } = wrap(state, 4);
    blocks[0].writeUInt16LE(1, 4);
    expect(reason(() => openEnvelope((i) => blocks[i], opts(n)))).toBe('version');
    try {
      openEnvelope((i) => blocks[i], opts(n));
    } catch (e) {
      expect((e as KvRejected).code).toBe('NIXL_ERR_NOT_SUPPORTED');
    }
  });

  it('the continuation is fields of the header', () => {
    const state = seqState(4, 10);
    const { blocks } = wrap(state, 4, 99, undefined, 5, 6);
    expect(blocks[0].readUInt32LE(ENVELOPE_FIELDS.promptTokens)).toBe(4);
    expect(blocks[0].readUInt32LE(ENVELOPE_FIELDS.nextToken)).toBe(100);
    expect(blocks[0].readUInt32LE(ENVELOPE_FIELDS.seed)).toBe(5);
    expect(blocks[0].readUInt32LE(ENVELOPE_FIELDS.samplingKey)).toBe(6);
    expect(blocks[0].readUInt32LE(ENVELOPE_FIELDS.batch)).toBe(0);
  });

  it('the batch size the state was evaluated in travels sealed, and reads back', () => {
    const state = seqState(4, 10);
    const blocks = Array.from({ length: 4 }, () => Buffer.alloc(BLOCK));
    const info = { promptTokens: 4, fingerprint: FP, seed: 0, samplingKey: 0, batch: 512, binding: BIND };
    writeEnvelope(stateHeader(state, info, 'k'), state, BLOCK, (i) => blocks[i]);
    const n = Math.ceil(envelopeBytes(state.length) / BLOCK);
    expect(openEnvelope((i) => blocks[i], opts(n, 'k')).batch).toBe(512);
    blocks[0].writeUInt32LE(16, ENVELOPE_FIELDS.batch);
    expect(reason(() => openEnvelope((i) => blocks[i], opts(n, 'k')))).toBe('unauthenticated');
  });

  it('random bytes, and any one byte of a good envelope changed: KvRejected, never the wrong state', () => {
    fc.assert(
      fc.property(fc.uint8Array({ minLength: 1, maxLength: 4 * BLOCK }), (bytes) => {
        const n = Math.ceil(bytes.length / BLOCK);
        const blocks = Array.from({ length: n }, (_, i) => {
          const b = Buffer.alloc(BLOCK);
          Buffer.from(bytes.subarray(i * BLOCK, (i + 1) * BLOCK)).copy(b);
          return b;
        });
        expect(reason(() => openEnvelope((i) => blocks[i], opts(n)))).not.toBe('accepted');
      }),
      { numRuns: Number(process.env.FC_RUNS ?? 200) },
    );
    const state = seqState(20, 500);
    fc.assert(
      fc.property(fc.nat(envelopeBytes(state.length) - 1), fc.integer({ min: 1, max: 255 }), (at, x) => {
        const { blocks, n } = wrap(state, 20);
        blocks[Math.floor(at / BLOCK)][at % BLOCK] ^= x;
        expect(reason(() => openEnvelope((i) => blocks[i], opts(n)))).not.toBe('accepted');
      }),
      { numRuns: Number(process.env.FC_RUNS ?? 300) },
    );
  });
});
