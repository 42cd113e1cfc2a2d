// Push mode's wire without NIXL: the hash with transfer_mode (the spec's
// worked example), PUSH_REG bytes exactly as vLLM's push scheduler encodes
// them, hostile registrations, push kv_transfer_params in both profiles, and
// pull and push peers refusing each other by name.
import { describe, expect, it } from 'vitest';
import { NixlError } from '../../lib';
import {
  TransferModeError,
  buildKvTransferParams,
  computeCompatibilityHash,
  type CompatibilityFactors,
} from '../../lib/handshake';
import { encodeHandshakePayload } from '../../lib/handshake/payload';
import { packMsgpack } from '../../lib/handshake/msgpack';
import { checkCompatibilityHash, openHandshakePayload } from '../../lib/handshake/wire';
import {
  PUSH_REG_PREFIX,
  type PushRegistration,
  decodePushReg,
  encodePushReg,
  expectedWrites,
  parsePushParams,
  writeNotif,
} from '../../lib/kv/push/reg';

// The factors of the worked example (vllm-side-channel.md §3, vllm-nixl-push.md §2.7).
const factors = (transferMode: 'pull' | 'push'): CompatibilityFactors => ({
  vllmVersion: '0.26.0',
  model: 'demo/llama-tiny',
  dtype: 'torch.bfloat16',
  numKvHeads: 8,
  headSize: 128,
  numHiddenLayers: 4,
  attnBackendName: 'FLASH_ATTN',
  cacheDtype: 'auto',
  isHmaEnabled: false,
  speculativeConfig: null,
  transferMode,
});

const EXAMPLE: PushRegistration = {
  requestId: 'cmpl-r1-0a1b2c3d',
  decodeEngineId: 'dec-0',
  decodeHost: '10.0.0.2',
  decodePort: 5601,
  decodeTpSize: 1,
  localBlockIds: [[7, 8, 9]],
  remoteEngineId: 'pre-0',
  remoteHost: '10.0.0.1',
  remotePort: 5600,
  remoteTpSize: 1,
  remotePpSize: 1,
};

/** The spec's §2.4 listing, byte for byte, built from its tokens (not from our encoder). */
function specBytes(): Buffer {
  const s = (t: string) => Buffer.concat([Buffer.from([0xa0 | t.length]), Buffer.from(t)]);
  const b = (...x: number[]) => Buffer.from(x);
  return Buffer.concat([
    Buffer.from('PUSH_REG:'),
    b(0x8b),
    s('request_id'),
    s('cmpl-r1-0a1b2c3d'),
    s('decode_engine_id'),
    s('dec-0'),
    s('decode_host'),
    s('10.0.0.2'),
    s('decode_port'),
    b(0xcd, 0x15, 0xe1),
    s('decode_tp_size'),
    b(0x01),
    s('local_block_ids'),
    b(0x91, 0x93, 0x07, 0x08, 0x09),
    s('remote_engine_id'),
    s('pre-0'),
    s('remote_host'),
    s('10.0.0.1'),
    s('remote_port'),
    b(0xcd, 0x15, 0xe0),
    s('remote_tp_size'),
    b(0x01),
    s('remote_pp_size'),
    b(0x01),
  ]);
}

const refused = (f: () => unknown, code: string, re: RegExp) => {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(NixlError);
    expect((e as NixlError).code).toBe(code);
    expect((e as Error).message).toMatch(re);
    return;
  }
  throw new Error('not refused');
};

describe('compatibility hash with transfer_mode', () => {
  it("gives the spec's worked example in both modes", () => {
    expect(computeCompatibilityHash(factors('push'), 'v12')).toBe(
      '95612a60a4dca23589141fb4a09839fbb763bcac62043d5201c86df789efca06',
    );
    expect(computeCompatibilityHash(factors('pull'), 'v12')).toBe(
      '6627cbad889d5c635fcdab00facce119940104aa684c685dc517ada5f5cfdadd',
    );
  });

  it('v0.13 has no push: asking for a push hash there is NOT_SUPPORTED', () => {
    refused(
      () => computeCompatibilityHash(factors('push'), 'v0.13'),
      'NIXL_ERR_NOT_SUPPORTED',
      /not part of the v0.13/,
    );
  });

  it('a pull peer and a push peer refuse each other with a TransferModeError that says so', () => {
    const pull = computeCompatibilityHash(factors('pull'), 'v12');
    const push = computeCompatibilityHash(factors('push'), 'v12');
    for (const [local, remote, lm, rm] of [
      [pull, push, 'pull', 'push'],
      [push, pull, 'push', 'pull'],
    ] as const) {
      let err: unknown;
      try {
        checkCompatibilityHash(remote, local);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(TransferModeError);
      expect(err).toMatchObject({ code: 'NIXL_ERR_MISMATCH', localMode: lm, remoteMode: rm });
      expect((err as Error).message).toMatch(new RegExp(`this engine moves KV by ${lm} and the peer by ${rm}`));
    }
    // Through the payload a ZMQ fetch opens, too.
    const payload = { compatibilityHash: push, agentMetadataBytes: Buffer.alloc(0) };
    expect(encodeHandshakePayload(payload).length).toBeGreaterThan(64);
    expect(() => openHandshakePayload(payload, pull, 'v12')).toThrow(TransferModeError);
    // Another model is not a transfer-mode mismatch.
    const other = computeCompatibilityHash({ ...factors('push'), model: 'x' }, 'v12');
    expect(() => checkCompatibilityHash(other, pull)).toThrow(/compatibility hash mismatch/);
    expect(() => checkCompatibilityHash(other, pull)).not.toThrow(TransferModeError);
  });
});

describe('push kv_transfer_params', () => {
  const common = {
    remoteEngineId: 'pre-0',
    remoteRequestId: 'cmpl-r1-0a1b2c3d',
    remoteHost: '10.0.0.1',
    remotePort: 5600,
    tpSize: 1,
    remoteBlockIds: [[1, 2, 3]],
    remoteNumTokens: 40,
  };

  it("v12: vLLM's push scheduler keys (no dcp_size, no expiry), transfer_mode push", () => {
    const p = buildKvTransferParams({ ...common, transferMode: 'push' }, 'v12');
    expect(Object.keys(p)).toEqual([
      'do_remote_prefill',
      'do_remote_decode',
      'remote_block_ids',
      'remote_engine_id',
      'remote_request_id',
      'remote_host',
      'remote_port',
      'tp_size',
      'pp_size',
      'remote_num_tokens',
      'transfer_mode',
    ]);
    expect(p.transfer_mode).toBe('push');
    expect(buildKvTransferParams(common, 'v12').transfer_mode).toBe('pull');
  });

  it('v0.13 has no transfer_mode: push params are NOT_SUPPORTED', () => {
    refused(
      () => buildKvTransferParams({ ...common, transferMode: 'push' }, 'v0.13'),
      'NIXL_ERR_NOT_SUPPORTED',
      /not part of the v0.13/,
    );
  });

  it("a push decode's params: required keys, pp_size required, a pull prefill's params named", () => {
    const d = {
      do_remote_prefill: true,
      remote_engine_id: 'pre-0',
      remote_request_id: 'u-1',
      remote_host: '127.0.0.1',
      remote_port: 5600,
      tp_size: 2,
      pp_size: 1,
    };
    expect(parsePushParams(d)).toEqual({
      remoteEngineId: 'pre-0',
      remoteRequestId: 'u-1',
      remoteHost: '127.0.0.1',
      remotePort: 5600,
      tpSize: 2,
      ppSize: 1,
    });
    const { pp_size: _p, ...noPp } = d;
    refused(() => parsePushParams(noPp), 'NIXL_ERR_INVALID_PARAM', /'pp_size' is missing/);
    for (const k of ['remote_engine_id', 'remote_host', 'remote_port', 'tp_size', 'remote_request_id']) {
      const { [k]: _x, ...rest } = d as Record<string, unknown>;
      refused(() => parsePushParams(rest), 'NIXL_ERR_INVALID_PARAM', new RegExp(k));
    }
    refused(() => parsePushParams({ ...d, tp_size: 4096 }), 'NIXL_ERR_INVALID_PARAM', /tp_size/);
    refused(() => parsePushParams({ ...d, pp_size: 2 ** 24 }), 'NIXL_ERR_INVALID_PARAM', /pp_size/);
    refused(() => parsePushParams({ ...d, remote_request_id: 'HB:x' }), 'NIXL_ERR_INVALID_PARAM', /heartbeat/);
    expect(() => parsePushParams({ ...d, transfer_mode: 'pull' })).toThrow(TransferModeError);
  });
});

describe('PUSH_REG', () => {
  it("encodes the spec's example byte for byte (225 bytes)", () => {
    const got = encodePushReg(EXAMPLE);
    expect(got.length).toBe(225);
    expect(got.toString('hex')).toBe(specBytes().toString('hex'));
    expect(decodePushReg(got)).toEqual(EXAMPLE);
  });

  it("reads vLLM's map in any key order, with extra keys, a flat block list, and no remote_pp_size", () => {
    const m = new Map<string, unknown>([
      ['remote_tp_size', 1],
      ['extra', 'ignored'],
      ['local_block_ids', [7, 8, 9]],
      ['request_id', 'cmpl-r1-0a1b2c3d'],
      ['decode_engine_id', 'dec-0'],
      ['decode_host', '10.0.0.2'],
      ['decode_port', 5601],
      ['decode_tp_size', 1],
      ['remote_engine_id', 'pre-0'],
      ['remote_host', '10.0.0.1'],
      ['remote_port', 5600],
    ]);
    const msg = Buffer.concat([PUSH_REG_PREFIX, packMsgpack(m as never)]);
    expect(decodePushReg(msg)).toEqual(EXAMPLE);
  });

  it('refuses garbage, non-maps, bad ids, out-of-range and huge lists without a crash', () => {
    const reg = (over: Record<string, unknown>) => {
      const m = new Map<string, unknown>(
        Object.entries({
          request_id: 'r',
          decode_engine_id: 'd',
          decode_host: 'h',
          decode_port: 1,
          decode_tp_size: 1,
          local_block_ids: [[1]],
          remote_engine_id: 'p',
          remote_host: 'h',
          remote_port: 1,
          remote_tp_size: 1,
          remote_pp_size: 1,
          ...over,
        }),
      );
      for (const [k, v] of m) if (v === undefined) m.delete(k);
      return Buffer.concat([PUSH_REG_PREFIX, packMsgpack(m as never)]);
    };
    const cases: Array<[Buffer, RegExp]> = [
      [Buffer.concat([PUSH_REG_PREFIX, Buffer.from([0xc1, 0xff])]), /not valid msgpack/],
      [Buffer.concat([PUSH_REG_PREFIX, packMsgpack([1, 2])]), /not a map/],
      [Buffer.concat([PUSH_REG_PREFIX, packMsgpack('x')]), /not a map/],
      [reg({ request_id: undefined }), /request_id/],
      [reg({ request_id: 5 }), /request_id/],
      [reg({ request_id: 'a,b' }), /request_id/],
      [reg({ decode_port: 70000 }), /decodePort/],
      [reg({ local_block_ids: [[-1]] }), /block ids must be integers/],
      [reg({ local_block_ids: [[2 ** 31]] }), /block ids must be integers/],
      [reg({ local_block_ids: [[2n ** 63n]] }), /block ids must be integers/],
      [reg({ local_block_ids: [] }), /local_block_ids/],
      [reg({ local_block_ids: [['1']] }), /block ids must be integers/],
      [reg({ remote_tp_size: 4096 }), /remoteTpSize/],
    ];
    for (const [msg, re] of cases) refused(() => decodePushReg(msg), 'NIXL_ERR_INVALID_PARAM', re);
    // The widest msgpack int (uint64 max) is read exactly, as a bigint, and refused as an id.
    const u64max = reg({ local_block_ids: [[2n ** 64n - 1n]] });
    refused(() => decodePushReg(u64max), 'NIXL_ERR_INVALID_PARAM', /block ids must be integers/);
    // A float where an int belongs (msgspec would refuse it too).
    const f = Buffer.from(reg({ local_block_ids: [[1]] }));
    const at = f.indexOf(Buffer.from([0x91, 0x91, 0x01]));
    const asFloat = Buffer.concat([
      f.subarray(0, at + 2),
      Buffer.from([0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]),
      f.subarray(at + 3),
    ]);
    refused(() => decodePushReg(asFloat), 'NIXL_ERR_INVALID_PARAM', /block ids must be integers/);
    // Huge lists: over the id limit, and over the byte limit.
    const many = reg({ local_block_ids: [Array.from({ length: 5000 }, (_, i) => i)] });
    refused(
      () => decodePushReg(many, { limits: { maxBlocks: 4096 } }),
      'NIXL_ERR_INVALID_PARAM',
      /over 4096 block ids/,
    );
    refused(
      () => decodePushReg(many, { limits: { maxBytes: 1024 } }),
      'NIXL_ERR_INVALID_PARAM',
      /over the limit of 1024/,
    );
  });

  it('with a secret: signed registrations pass; unsigned, altered or foreign ones are NOT_ALLOWED', () => {
    const signed = encodePushReg(EXAMPLE, 's3cret');
    expect(decodePushReg(signed, { secret: 's3cret' })).toEqual(EXAMPLE);
    // vLLM's prefill decodes untyped and ignores the extra key.
    expect(decodePushReg(signed)).toEqual(EXAMPLE);
    refused(() => decodePushReg(encodePushReg(EXAMPLE), { secret: 's3cret' }), 'NIXL_ERR_NOT_ALLOWED', /not signed/);
    refused(() => decodePushReg(signed, { secret: 'other' }), 'NIXL_ERR_NOT_ALLOWED', /signature does not match/);
    const altered = Buffer.from(signed);
    altered[altered.indexOf(Buffer.from([0x93, 0x07, 0x08, 0x09])) + 1] = 0x06; // block 7 -> 6
    refused(() => decodePushReg(altered, { secret: 's3cret' }), 'NIXL_ERR_NOT_ALLOWED', /signature does not match/);
  });

  it('WRITE notifications and how many a decode rank waits for (vLLM: pp x max(1, P_tp // D_tp))', () => {
    expect(Buffer.from(writeNotif(EXAMPLE.requestId, 1)).toString('hex')).toBe('636d706c2d72312d30613162326333643a31');
    const table: Array<[number, number, number, number]> = [
      [1, 1, 1, 1],
      [1, 4, 1, 4],
      [1, 4, 2, 2],
      [1, 1, 4, 1],
      [1, 2, 4, 1],
      [2, 2, 1, 4],
    ];
    for (const [pp, ptp, dtp, n] of table) expect(expectedWrites(pp, ptp, dtp)).toBe(n);
  });
});
