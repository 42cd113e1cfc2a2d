// The XXH64 checksum of a KV state envelope without a KV secret, attacked:
// chunked and whole inputs hash alike, a large state leaves no copy of itself
// behind in the hash's memory, flags relabelled either way are refused, and
// states of 0 bytes and of many blocks round-trip.
import { randomBytes } from 'node:crypto';
import xxhash from 'xxhash-wasm';
import { beforeAll, describe, expect, it } from 'vitest';
import {
  HEADER_BYTES,
  envelopeBytes,
  openEnvelope,
  resealEnvelope,
  stateHeader,
  writeEnvelope,
} from '../../lib/serving/models/kv-state';
import { stateChecksum, stateChecksumReady } from '../../lib/serving/models/state-checksum';
import { kvRejectedReason as reason } from '../helpers';
import { BIND, FP, envelopeOptions } from './kv-state-helpers';

let raw: Awaited<ReturnType<typeof xxhash>>;

beforeAll(async () => {
  await stateChecksumReady();
  raw = await xxhash();
});

/** The envelope of `state` in blocks of `block` bytes (with a secret: an HMAC). */
function sealed(state: Buffer, block: number, secret?: string) {
  const n = Math.ceil(envelopeBytes(state.length) / block);
  const env = Buffer.alloc(n * block);
  const info = { promptTokens: 3, fingerprint: FP, nextToken: 1, seed: 0, samplingKey: 0, binding: BIND };
  writeEnvelope(stateHeader(state, info, secret), state, block, (i) => env.subarray(i * block, (i + 1) * block));
  return { env, n, block };
}

function open(e: { env: Buffer; n: number; block: number }, secret?: string) {
  return openEnvelope(
    (i) => e.env.subarray(i * e.block, (i + 1) * e.block),
    envelopeOptions(e.n, e.block, 1 << 30, secret),
  );
}

describe('the XXH64 state checksum', () => {
  it('is XXH64 of the parts one after the other, however they are cut', () => {
    const all = randomBytes(3 << 20);
    const want = raw.h64Raw(all);
    for (const cuts of [[], [1], [7, 8, 9], [1 << 20], [(1 << 20) - 1, (2 << 20) + 3]]) {
      const parts: Buffer[] = [];
      let at = 0;
      for (const c of cuts) {
        parts.push(all.subarray(at, c));
        at = c;
      }
      parts.push(all.subarray(at));
      expect(stateChecksum(parts).readBigUInt64LE(0)).toBe(want);
    }
    expect(stateChecksum([]).readBigUInt64LE(0)).toBe(raw.h64Raw(new Uint8Array(0)));
  });

  it('a large state leaves no copy of itself in the checksum memory (it grew by the state before)', () => {
    const big = Buffer.alloc(64 << 20, 7);
    const before = process.memoryUsage().external;
    const sum = stateChecksum([big]);
    const grown = process.memoryUsage().external - before;
    expect(grown).toBeLessThan(16 << 20);
    expect(sum.readBigUInt64LE(0)).toBe(raw.h64Raw(big));
    // And a small one after it hashes right.
    expect(stateChecksum([Buffer.from('abc')]).readBigUInt64LE(0)).toBe(raw.h64Raw(Buffer.from('abc')));
  });

  it('interleaved seals and opens of different states each check out', () => {
    const a = sealed(randomBytes(100_000), 4096);
    const b = sealed(randomBytes(5), 256);
    const c = sealed(Buffer.alloc(0), 256);
    for (let i = 0; i < 3; i++) for (const e of [a, b, c, b, a]) expect(reason(() => open(e))).toBe('accepted');
  });

  it('a state of 0 bytes, and one across many blocks, round-trip; a byte changed anywhere is refused', () => {
    for (const [bytes, block] of [
      [0, 256],
      [1, 256],
      [3000, 100], // the header across three blocks
      [777, 7],
      [5 << 20, 4096],
    ] as const) {
      const state = randomBytes(bytes);
      const e = sealed(state, block);
      expect(open(e).state.equals(state)).toBe(true);
      for (const at of [0, 8, 23, 100, 224, 231, 232, 255, HEADER_BYTES, HEADER_BYTES + bytes - 1]) {
        if (at >= HEADER_BYTES + bytes) continue;
        const d = { ...e, env: Buffer.from(e.env) };
        d.env[at] ^= 0x40;
        expect(
          reason(() => open(d)),
          `byte ${at} of ${bytes}`,
        ).not.toBe('accepted');
      }
    }
  });

  it('relabelled flags are refused: XXH64 as SHA-256 and back, either as an HMAC, or both', () => {
    const state = randomBytes(3000);
    const xxh = sealed(state, 256);
    const sha = sealed(state, 256);
    sha.env.writeUInt32LE(0, 8);
    resealEnvelope(sha.env);
    expect(reason(() => open(sha))).toBe('accepted');
    for (const [e, flags, secret, why] of [
      [xxh, 0, undefined, 'corrupted'],
      [sha, 2, undefined, 'corrupted'],
      [xxh, 1, undefined, 'unauthenticated'],
      [xxh, 1, 'k', 'unauthenticated'],
      [sha, 1, 'k', 'unauthenticated'],
      [xxh, 3, undefined, 'malformed'],
      [xxh, 3, 'k', 'malformed'],
    ] as const) {
      const d = { ...e, env: Buffer.from(e.env) };
      d.env.writeUInt32LE(flags, 8);
      expect(
        reason(() => open(d, secret)),
        `flags ${flags}, secret ${secret}`,
      ).toBe(why);
    }
    // A SHA-256 envelope whose MAC is cut to XXH64's 8 bytes and 0s, then labelled XXH64.
    const cut = { ...sha, env: Buffer.from(sha.env) };
    cut.env.writeUInt32LE(2, 8);
    cut.env.fill(0, 232, 256);
    expect(reason(() => open(cut))).toBe('corrupted');
    // An HMAC envelope opened without a secret, and labelled a checksum.
    const mac = sealed(state, 256, 'k');
    expect(reason(() => open(mac))).toBe('unauthenticated');
    mac.env.writeUInt32LE(2, 8);
    expect(reason(() => open(mac))).toBe('corrupted');
  });

  // The worker side (the proxy's module graph touches Node's own fetch, whose
  // undici needs WebAssembly too: not this module's to fix).
  it('without WebAssembly (node --jitless) a worker still loads; the checksum says why it cannot', async () => {
    const { spawnSync } = await import('node:child_process');
    const path = await import('node:path');
    const script = `
      require('./dist/lib/serving/worker/worker');
      const c = require('./dist/lib/serving/models/state-checksum');
      c.stateChecksumReady().then(
        () => console.log('loaded'),
        (e) => setTimeout(() => console.log('refused', e.code, e.message), 100),
      );`;
    const r = spawnSync(process.execPath, ['--jitless', '-e', script], {
      cwd: path.join(__dirname, '..', '..'),
      encoding: 'utf8',
      timeout: 60_000,
    });
    expect(r.stderr).not.toMatch(/ReferenceError|Unhandled/);
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/refused NIXL_ERR_NOT_SUPPORTED .*WebAssembly/);
  });
});
