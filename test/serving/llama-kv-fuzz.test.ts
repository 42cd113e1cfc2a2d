// Fuzzing a GGUF decode's state loading through a real pull: a prefill whose
// envelopes (header and llama.cpp state) are mutated, most sealed again as
// anyone can without a KV secret, a decode that pulls and must answer each
// with 200 (only K / V values changed) or a typed 502 kv_rejected (a reason
// and a NixlError code; always when the change was not sealed again: the
// checksum's job), never anything else, never a crash; and after each
// case the next honest request gets the answer it got before.
// FUZZ_RUNS cases (default 500: 12-22 s on 2 shared cores), FUZZ_SEED to replay one run.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import fc from 'fast-check';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { type Worker, startWorker } from '../../lib/serving';
import { ENVELOPE_FIELDS, HEADER_BYTES, resealEnvelope } from '../../lib/serving/models/kv-state';
import { at, chat, completion, disaggregated, options } from '../llama-kv-helpers';

const runs = Number(process.env.FUZZ_RUNS ?? 500);
const seed = Number(process.env.FUZZ_SEED ?? 3030);
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-fuzz-'));
const asks = [completion('the cat sat on the mat and'), chat('tell me about rivers')];
const honest: string[] = [];
let prefill: Worker;
let decode: Worker;
let mutate: ((env: Buffer) => Buffer) | undefined;

beforeAll(async () => {
  const gguf = modelPath('tiny', dir);
  prefill = await startWorker({
    ...options,
    model: gguf,
    testHooks: { tamperKv: (env) => (mutate ? mutate(env) : env) },
  });
  decode = await startWorker({ ...options, model: gguf });
  for (const b of asks) honest.push((await disaggregated(prefill, decode, b)).text);
}, 60_000);
afterAll(async () => {
  await prefill?.close();
  await decode?.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

/** Offsets that mean something in an envelope: header fields, then each field of llama.cpp's state. */
function fieldOffsets(env: Buffer): number[] {
  const n = at.tokens(env);
  const cells = at.position(env, 0);
  return [
    4,
    6,
    8,
    16,
    ENVELOPE_FIELDS.promptTokens,
    ENVELOPE_FIELDS.nextToken,
    ENVELOPE_FIELDS.seed,
    ENVELOPE_FIELDS.samplingKey,
    HEADER_BYTES,
    HEADER_BYTES + 4,
    HEADER_BYTES + 8,
    at.token(0),
    at.token(n - 1),
    at.cellCount(env) - 4,
    at.cellCount(env),
    cells,
    cells + 4,
    cells + 8,
    at.position(env, n - 1),
    at.position(env, n), // v_trans
    at.position(env, n) + 4, // n_layer
    at.position(env, n) + 8, // the first K type
    at.position(env, n) + 12, // its row size
  ];
}

const VALUES = [0, 1, 2, 3, 255, 258, 259, 260, 4096, 0x7fffffff, 0x80000000, 0xffffffff];

const mutation = fc.record({
  ask: fc.nat(asks.length - 1),
  reseal: fc.integer({ min: 0, max: 9 }).map((x) => x > 0), // 9 in 10 sealed again
  edit: fc.oneof(
    fc.record({
      k: fc.constant('field' as const),
      i: fc.nat(20),
      v: fc.constantFrom(...VALUES),
      d: fc.integer({ min: -2, max: 2 }),
    }),
    fc.record({
      k: fc.constant('flip' as const),
      p: fc.double({ min: 0, max: 1, noNaN: true }),
      x: fc.integer({ min: 1, max: 255 }),
    }),
    fc.record({ k: fc.constant('length' as const), d: fc.integer({ min: -64, max: 64 }) }),
  ),
});

type Mutation = typeof mutation extends fc.Arbitrary<infer T> ? T : never;

/** Whether the last mutation changed the envelope and left it unsealed: damage only the checksum can catch. */
let unsealedChange = false;

function apply(m: Mutation, env: Buffer): Buffer {
  const before = Buffer.from(env);
  const e = m.edit;
  if (e.k === 'field') {
    const offs = fieldOffsets(env);
    const off = offs[e.i % offs.length];
    // The value itself, or what is there nudged by d.
    const v = e.d === 0 ? e.v : (env.readUInt32LE(off) + e.d) >>> 0;
    env.writeUInt32LE(v, off);
  } else if (e.k === 'flip') {
    env[Math.floor(e.p * (env.length - 1))] ^= e.x;
  } else {
    env.writeBigUInt64LE(BigInt(Math.max(0, at.stateBytes(env) + e.d)), 16);
  }
  if (m.reseal) resealEnvelope(env);
  unsealedChange = !m.reseal && !env.equals(before);
  return env;
}

it(`mutated states through a real pull (${runs}, seed ${seed}): 200 or a typed 502, and the next honest request served`, async () => {
  const outcomes: Record<string, number> = {};
  let i = 0;
  await fc.assert(
    fc.asyncProperty(mutation, async (m) => {
      unsealedChange = false;
      mutate = (env) => apply(m, env);
      let g: Awaited<ReturnType<typeof disaggregated>>;
      try {
        g = await disaggregated(prefill, decode, { ...asks[m.ask], max_tokens: 2 });
      } finally {
        mutate = undefined;
      }
      // A change sealed again may be served; one left unsealed never is.
      if (unsealedChange) expect(g.status, `an unsealed change served: ${JSON.stringify(m)}`).toBe(502);
      if (g.status === 200) outcomes.served = (outcomes.served ?? 0) + 1;
      else {
        expect(g.status, JSON.stringify(g)).toBe(502);
        expect(g.error?.type).toBe('kv_rejected');
        expect(g.error?.nixl_code).toMatch(/^NIXL_ERR_/);
        const k = `${g.error?.reason} (${g.error?.nixl_code})`;
        outcomes[k] = (outcomes[k] ?? 0) + 1;
      }
      const n = i++ % asks.length;
      const ok = await disaggregated(prefill, decode, asks[n]);
      expect(ok.status, JSON.stringify(ok.error)).toBe(200);
      expect(ok.text).toBe(honest[n]);
    }),
    { numRuns: runs, seed },
  );
  console.log(`llama KV fuzz through a pull: ${runs} cases, seed ${seed}:`, JSON.stringify(outcomes));
  expect(decode.stats.rejectedKv).toBe(Object.entries(outcomes).reduce((s, [k, v]) => s + (k === 'served' ? 0 : v), 0));
}, 600_000);
