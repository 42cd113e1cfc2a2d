// Well-formed msgpack and JSON of the wrong shapes, fed to every decoder of
// remote input: whatever comes, the error is the decoder's own (with a code),
// never a TypeError from building its message. Random bytes rarely get past
// the msgpack reader; these values do, with the real keys and the types that
// break String() and JSON.stringify (null-prototype maps, bigints to 2^64-1).
import { describe, expect, it } from 'vitest';
import { NixlError } from '../../lib';
import { decodeAgentMetadata, parseKvTransferParams, wireV12 } from '../../lib/handshake';
import { decodeHandshakePayload } from '../../lib/handshake/payload';
import { Float64, type MpValue, packMsgpack } from '../../lib/handshake/msgpack';
import { decodeMetaRequest, readReply } from '../../lib/handshake/wire';
import { decodePushReg, parsePushParams, PUSH_REG_PREFIX } from '../../lib/kv/push/reg';
import { checkGenerateRequest } from '../../lib/serving/api/generate';
import { RequestError, checkCompletionRequest } from '../../lib/serving/api/schema';

const KEYS = [
  'request_id',
  'local_block_ids',
  'remote_block_ids',
  'decode_engine_id',
  'remote_engine_id',
  'decode_host',
  'remote_host',
  'decode_port',
  'remote_port',
  'decode_tp_size',
  'remote_tp_size',
  'remote_pp_size',
  'remote_request_id',
  'transfer_mode',
  'tp_size',
  'pp_size',
  'engine_id',
  'agent_metadata',
  'kv_caches_base_addr',
  'num_blocks',
  'block_lens',
  'kv_cache_layout',
  'block_size',
  'compatibility_hash',
  'agent_metadata_bytes',
  'error',
  'code',
  'token_ids',
  'sampling_params',
  'prompt',
  'messages',
  'max_tokens',
  'kv_transfer_params',
];

async function arbitraries() {
  const fc = await import('fast-check');
  const leaf = fc.oneof(
    fc.constant(null),
    fc.boolean(),
    fc.integer({ min: -(2 ** 31), max: 2 ** 31 }),
    fc.bigInt({ min: -(1n << 63n), max: (1n << 64n) - 1n }),
    fc.double().map((d) => new Float64(d)),
    fc.oneof(fc.string({ maxLength: 12 }), fc.constantFrom('get_meta_msg', 'push', 'pull', 'HND', 'NHD', ...KEYS)),
    fc.uint8Array({ maxLength: 8 }).map((u) => Buffer.from(u)),
  );
  const { value } = fc.letrec<{ value: MpValue }>((tie) => ({
    value: fc.oneof(
      { depthSize: 'small', withCrossShrink: true },
      leaf,
      fc.array(tie('value'), { maxLength: 4 }),
      fc
        .array(fc.tuple(fc.oneof(fc.constantFrom(...KEYS), fc.string({ maxLength: 6 })), tie('value')), {
          maxLength: 6,
        })
        .map((kv) => new Map(kv)),
    ),
  }));
  return { fc, value };
}

/** The error a decoder is allowed to throw: a NixlError with a code, or a 400 RequestError. */
function expectOwnError(f: () => unknown, cls: typeof NixlError | typeof RequestError): void {
  try {
    f();
  } catch (e) {
    const own =
      cls === NixlError
        ? e instanceof NixlError && /^NIXL_ERR_[A-Z_]+$/.test(e.code)
        : e instanceof RequestError && e.status === 400;
    if (!own) throw e;
  }
}

describe('decoders of remote input, on well-formed values of the wrong shapes (fast-check)', () => {
  const runs = Number(process.env.FC_RUNS ?? 3000);

  it('side-channel requests, replies, payloads and metadata: HandshakeError only', async () => {
    const { fc, value } = await arbitraries();
    fc.assert(
      fc.property(value, (v) => {
        const b = packMsgpack(v);
        for (const w of ['v12', 'v0.13'] as const) {
          expectOwnError(() => decodeMetaRequest(b, w), NixlError);
          expectOwnError(() => decodeAgentMetadata(b, w), NixlError);
        }
        expectOwnError(() => decodeHandshakePayload(b), NixlError);
        expectOwnError(() => readReply([b, b], wireV12), NixlError);
      }),
      { numRuns: runs },
    );
  });

  it('push registrations (signed or not): NixlError only', async () => {
    const { fc, value } = await arbitraries();
    fc.assert(
      fc.property(value, (v) => {
        const msg = Buffer.concat([PUSH_REG_PREFIX, packMsgpack(v)]);
        expectOwnError(() => decodePushReg(msg), NixlError);
        expectOwnError(() => decodePushReg(msg, { secret: 's' }), NixlError);
      }),
      { numRuns: runs },
    );
  });

  it('kv_transfer_params and request bodies (JSON, and decoded msgpack): their own errors only', async () => {
    const { fc, value } = await arbitraries();
    const json = fc.dictionary(fc.constantFrom(...KEYS), fc.jsonValue({ maxDepth: 3 }), { maxKeys: 8 });
    const decoded = value.map((v) => {
      // What the msgpack reader gives back: null-prototype maps, bigints.
      const back = (x: MpValue): unknown =>
        x instanceof Map
          ? Object.assign(Object.create(null), Object.fromEntries([...x].map(([k, y]) => [k, back(y)])))
          : Array.isArray(x)
            ? x.map(back)
            : x;
      return back(v);
    });
    fc.assert(
      fc.property(fc.oneof(json, decoded), (o) => {
        for (const w of ['v12', 'v0.13'] as const) expectOwnError(() => parseKvTransferParams(o, w), NixlError);
        expectOwnError(() => parsePushParams(o), NixlError);
        if (typeof o !== 'object' || o === null || Array.isArray(o)) return;
        const body = o as Record<string, unknown>;
        for (const path of ['/v1/completions', '/v1/chat/completions'])
          for (const kv of ['object', 'refuse'] as const)
            expectOwnError(() => checkCompletionRequest(path, body, { kvTransferParams: kv }), RequestError);
        for (const kv of ['object', 'refuse'] as const)
          expectOwnError(() => checkGenerateRequest(body, { kvTransferParams: kv }), RequestError);
      }),
      { numRuns: runs },
    );
  });

  it('the counterexamples found so far', () => {
    const u64 = (1n << 64n) - 1n;
    const reqs = [
      new Map<string, MpValue>([['request_id', new Map([['a', u64]])]]),
      new Map<string, MpValue>([['request_id', [u64]]]),
    ];
    for (const r of reqs)
      expect(() => decodePushReg(Buffer.concat([PUSH_REG_PREFIX, packMsgpack(r)]))).toThrow(/request_id/);
    expect(() => parsePushParams({ transfer_mode: { a: 1n } })).toThrow(/transfer_mode must be 'push', got/);
    expect(() => parsePushParams({ transfer_mode: Object.create(null) })).toThrow(/transfer_mode/);
  });
});
