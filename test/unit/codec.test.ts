// Byte-exact vectors for both wire profiles, made with Python's msgpack + json
// (test/vectors/make_vectors.py), and the strict reader's refusals.
import { describe, expect, it } from 'vitest';
import vectors from '../vectors/handshake.json';
import {
  HandshakeError,
  buildKvTransferParams,
  computeCompatibilityHash,
  decodeAgentMetadata,
  encodeAgentMetadata,
  parseKvTransferParams,
  wireProfile,
  wireV12,
  wireV013,
  type NixlAgentMetadata,
} from '../../lib/handshake';
import { Float64, packMsgpack, unpackMsgpack } from '../../lib/handshake/msgpack';
import { GET_META_MSG, decodeHandshakePayload, encodeHandshakePayload } from '../../lib/handshake/payload';
import { hashFactors, pyJsonDumps, type HashFactor } from '../../lib/handshake/py-json';
import { absentMetadataFields } from '../../lib/handshake/model';
import {
  decodeMetaRequest,
  encodeMetaRequest,
  openHandshakePayload,
  readReply,
  replyFrames,
} from '../../lib/handshake/wire';

type V013 = (typeof vectors.metadata)[number];
type V12 = (typeof vectors.v12.metadata)[number]['fields'];

function fromV013(v: V013): NixlAgentMetadata {
  return {
    engineId: v.engine_id,
    agentMetadata: Buffer.from(v.agent_metadata, 'hex'),
    kvCachesBaseAddr: v.kv_caches_base_addr.map(BigInt),
    deviceId: v.device_id,
    numBlocks: v.num_blocks,
    blockLens: v.block_lens,
    blockStrides: v.block_lens,
    kvCacheLayout: v.kv_cache_layout === 'HND' ? 'LBHNC' : 'LBNHC',
    blockSize: v.block_size,
    ...absentMetadataFields(),
    attnBackendName: '',
  };
}

function fromV12(v: V12): NixlAgentMetadata {
  return {
    engineId: v.engine_id,
    agentMetadata: Buffer.from(v.agent_metadata, 'hex'),
    kvCachesBaseAddr: v.kv_caches_base_addr.map(BigInt),
    deviceId: v.device_id,
    numBlocks: v.num_blocks,
    blockLens: v.block_lens,
    blockStrides: v.block_strides,
    kvCacheLayout: v.kv_cache_layout as NixlAgentMetadata['kvCacheLayout'],
    blockSize: v.block_size,
    ssmSizes: v.ssm_sizes as [number, number],
    attnBackendName: v.attn_backend_name,
    physicalBlocksPerLogical: v.physical_blocks_per_logical_kv_block,
    regionNumBlocks: v.region_num_blocks,
    regionGroupIds: v.region_group_ids,
    regionNames: v.region_names,
    regionMemTypes: v.region_mem_types,
    dcpSize: v.dcp_size,
    pcpSize: v.pcp_size,
    regionMembers: v.region_members,
  };
}

/** A v12 metadata map with one key changed (undefined: removed), in field order. */
function v12Map(change: Record<string, unknown> = {}): Buffer {
  const f = vectors.v12.metadata[0].fields as Record<string, unknown>;
  const m = new Map<string, never>();
  for (const [k, v] of Object.entries(f)) {
    const x =
      k in change
        ? change[k]
        : k === 'agent_metadata'
          ? Buffer.from(v as string, 'hex')
          : k === 'kv_caches_base_addr'
            ? (v as string[]).map(BigInt)
            : v;
    if (x !== undefined) m.set(k, x as never);
  }
  for (const [k, v] of Object.entries(change)) if (!(k in f) && v !== undefined) m.set(k, v as never);
  return packMsgpack(m);
}

describe('NixlAgentMetadata, v0.13 profile (8 keys)', () => {
  it.each(vectors.metadata.map((v, i) => [i, v] as const))('vector %i encodes byte-exact and decodes back', (_i, v) => {
    const m = fromV013(v);
    expect(encodeAgentMetadata(m, 'v0.13').toString('hex')).toBe(v.hex);
    expect(decodeAgentMetadata(Buffer.from(v.hex, 'hex'), 'v0.13')).toEqual(m);
  });

  it('accepts HND/NHD from callers and never packs a 64-bit address as a float', () => {
    const m = { ...fromV013(vectors.metadata[0]), kvCacheLayout: 'HND' as const, kvCachesBaseAddr: [0x7f3a00000000n] };
    const hex = encodeAgentMetadata(m, 'v0.13').toString('hex');
    expect(hex).toContain('91cf00007f3a00000000'); // [uint64], not float64 (0xcb)
    expect(packMsgpack(2 ** 40).toString('hex')).toBe('cf0000010000000000');
    expect(() => packMsgpack(1.5)).toThrow(HandshakeError);
    expect(decodeAgentMetadata(encodeAgentMetadata(m, 'v0.13'), 'v0.13').kvCachesBaseAddr[0]).toBe(0x7f3a00000000n);
  });

  it('rejects missing or mistyped keys naming the key, and a v12 layout name', () => {
    const base = vectors.metadata[0];
    const map = (key: string, replace?: unknown) => {
      const entries = Object.entries({
        engine_id: base.engine_id,
        agent_metadata: Buffer.from(base.agent_metadata, 'hex'),
        kv_caches_base_addr: base.kv_caches_base_addr.map(BigInt),
        device_id: base.device_id,
        num_blocks: base.num_blocks,
        block_lens: base.block_lens,
        kv_cache_layout: base.kv_cache_layout,
        block_size: base.block_size,
        future_field: 'ignored',
      })
        .filter(([k]) => k !== key || replace !== undefined)
        .map(([k, v]) => [k, k === key ? replace : v]);
      return packMsgpack(new Map(entries as [string, never][]));
    };
    expect(decodeAgentMetadata(map('none'), 'v0.13').engineId).toBe('prefill-0');
    expect(() => decodeAgentMetadata(map('num_blocks'), 'v0.13')).toThrow(/missing required field 'num_blocks'/);
    expect(() => decodeAgentMetadata(map('engine_id', 5), 'v0.13')).toThrow(/'engine_id' must be a str, got int 5/);
    expect(() => decodeAgentMetadata(map('kv_caches_base_addr', ['a']), 'v0.13')).toThrow(/kv_caches_base_addr/);
    expect(() => decodeAgentMetadata(map('kv_cache_layout', 'LBHNC'), 'v0.13')).toThrow(/not a v0.13 layout/);
    expect(() => decodeAgentMetadata(map('agent_metadata', 'str'), 'v0.13')).toThrow(/must be bin/);
    expect(() => decodeAgentMetadata(Buffer.from([0xc1]), 'v0.13')).toThrow(HandshakeError);
    expect(() => decodeAgentMetadata(packMsgpack([1, 2]), 'v0.13')).toThrow(/expected a map/);
  });
});

describe('NixlAgentMetadata, v12 profile (19 keys, msgspec encoding)', () => {
  it.each(vectors.v12.metadata.map((v, i) => [i, v] as const))(
    'vector %i encodes byte-exact and decodes back',
    (_i, v) => {
      const m = fromV12(v.fields);
      expect(encodeAgentMetadata(m, 'v12').toString('hex')).toBe(v.hex);
      expect(decodeAgentMetadata(Buffer.from(v.hex, 'hex'), 'v12')).toEqual(m);
    },
  );

  it('sends every field: nil for unset region fields, ints never floats, ssm_sizes a 2-array', () => {
    const {
      regionNumBlocks: _a,
      regionGroupIds: _b,
      regionNames: _c,
      regionMemTypes: _d,
      ...m
    } = fromV12(vectors.v12.metadata[0].fields);
    const enc = encodeAgentMetadata({ ...m, ssmSizes: undefined, dcpSize: undefined, regionMembers: undefined }, 'v12');
    expect(enc.toString('hex')).toBe(vectors.v12.metadata[0].hex);
    const o = unpackMsgpack(enc, 't') as Record<string, unknown>;
    expect(Object.keys(o)).toHaveLength(19);
    expect(o.region_names).toBeNull();
    expect(o.ssm_sizes).toEqual([0, 0]);
    expect(o.region_members).toEqual([]);
    expect(enc.includes(0xcb)).toBe(false);
  });

  it('decodes as msgspec does: extra keys ignored, optional fields default, types strict', () => {
    const ok = decodeAgentMetadata(v12Map({ future: 'x', region_names: undefined, dcp_size: undefined }), 'v12');
    expect(ok.regionNames).toBeNull();
    expect(ok.dcpSize).toBe(1);
    expect(() => decodeAgentMetadata(v12Map({ block_strides: undefined }), 'v12')).toThrow(
      /missing required field 'block_strides' \(a v0.13/,
    );
    expect(() => decodeAgentMetadata(v12Map({ num_blocks: new Float64(16) }), 'v12')).toThrow(
      /'num_blocks' must be an int, got float 16/,
    );
    expect(() => decodeAgentMetadata(v12Map({ ssm_sizes: [0, 0, 0] }), 'v12')).toThrow(/exactly 2 ints/);
    expect(() => decodeAgentMetadata(v12Map({ dcp_size: null }), 'v12')).toThrow(/'dcp_size' must be an int, got nil/);
    expect(() => decodeAgentMetadata(v12Map({ region_members: null }), 'v12')).toThrow(/region_members/);
    expect(() => decodeAgentMetadata(v12Map({ engine_id: Buffer.from('x') }), 'v12')).toThrow(/must be a str, got bin/);
    expect(() => decodeAgentMetadata(v12Map({ kv_cache_layout: 'HND' }), 'v12')).toThrow(/HND\/NHD are v0.13 names/);
    expect(() => decodeAgentMetadata(v12Map({ kv_caches_base_addr: [-1] }), 'v12')).toThrow(/uint64/);
    // A v0.13 map: the first missing required v12 field is named.
    expect(() => decodeAgentMetadata(Buffer.from(vectors.metadata[0].hex, 'hex'), 'v12')).toThrow(/block_strides/);
  });

  it('the reader refuses trailing bytes, ext types, truncation and deep nesting', () => {
    const good = Buffer.from(vectors.v12.metadata[0].hex, 'hex');
    expect(() => decodeAgentMetadata(Buffer.concat([good, Buffer.from([0])]), 'v12')).toThrow(/1 trailing bytes/);
    expect(() => decodeAgentMetadata(good.subarray(0, good.length - 3), 'v12')).toThrow(/truncated/);
    expect(() => unpackMsgpack(Buffer.from([0xd4, 1, 1]), 'x')).toThrow(/ext types/);
    expect(() => unpackMsgpack(Buffer.from([0xdd, 0xff, 0xff, 0xff, 0xff]), 'x')).toThrow(/array of/);
    expect(() => unpackMsgpack(Buffer.alloc(100, 0x91), 'x')).toThrow(/nested deeper/);
    expect(() => unpackMsgpack(Buffer.from([0xa2, 0xc3, 0x28]), 'x')).toThrow(/UTF-8/);
    expect(unpackMsgpack(Buffer.from('cf8000000000000000', 'hex'), 'x')).toBe(1n << 63n);
  });
});

describe('NixlHandshakePayload (both profiles)', () => {
  it.each([...vectors.payload, ...vectors.v12.payload].map((v, i) => [i, v] as const))(
    'vector %i is byte-exact',
    (_i, v) => {
      const p = { compatibilityHash: v.compatibility_hash, agentMetadataBytes: Buffer.from(v.inner_hex, 'hex') };
      expect(encodeHandshakePayload(p).toString('hex')).toBe(v.hex);
      expect(decodeHandshakePayload(Buffer.from(v.hex, 'hex'))).toEqual(p);
    },
  );

  it('checks the compatibility hash unless told not to', () => {
    const v = vectors.v12.payload[0];
    const p = decodeHandshakePayload(Buffer.from(v.hex, 'hex'));
    expect(openHandshakePayload(p, v.compatibility_hash, 'v12').engineId).toBe('prefill-0');
    expect(openHandshakePayload(p, undefined, 'v12').engineId).toBe('prefill-0');
    expect(() => openHandshakePayload(p, 'f'.repeat(64), 'v12')).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_MISMATCH' }),
    );
  });
});

describe('side-channel requests and replies', () => {
  it.each(vectors.request.map((v, i) => [i, v] as const))('v0.13 vector %i', (_i, v) => {
    const tp = v.ranks[0];
    expect(encodeMetaRequest(tp, 0, 'v0.13').toString('hex')).toBe(v.hex);
    expect(decodeMetaRequest(Buffer.from(v.hex, 'hex'), 'v0.13')).toEqual({ tpRank: tp, ppRank: 0 });
  });

  it.each(vectors.v12.request.map((v, i) => [i, v] as const))('v12 vector %i', (_i, v) => {
    expect(encodeMetaRequest(v.tp_rank, v.pp_rank, 'v12').toString('hex')).toBe(v.hex);
    expect(decodeMetaRequest(Buffer.from(v.hex, 'hex'), 'v12')).toEqual({ tpRank: v.tp_rank, ppRank: v.pp_rank });
  });

  it("each profile refuses the other's request shape, naming it", () => {
    const v12req = encodeMetaRequest(1, 0, 'v12');
    const v013req = encodeMetaRequest(1, 0, 'v0.13');
    expect(() => decodeMetaRequest(v12req, 'v0.13')).toThrow(/3 elements is the v12 format/);
    expect(() => decodeMetaRequest(v013req, 'v12')).toThrow(/2 elements is the v0.13 format/);
    expect(() => decodeMetaRequest(GET_META_MSG, 'v12')).toThrow(/v0.13's per-rank-port form/);
    expect(decodeMetaRequest(GET_META_MSG, 'v0.13')).toEqual({ tpRank: undefined, ppRank: 0 });
    expect(() => encodeMetaRequest(0, 1, 'v0.13')).toThrow(/no pp_rank/);
    expect(() => decodeMetaRequest(packMsgpack([Buffer.from('other'), 0, 0]), 'v12')).toThrow(/unknown message/);
    expect(() => decodeMetaRequest(packMsgpack([GET_META_MSG, 0, -1]), 'v12')).toThrow(/tp_rank/);
    expect(() => decodeMetaRequest(packMsgpack([GET_META_MSG, new Float64(0), 1]), 'v12')).toThrow(/pp_rank/);
    expect(() => decodeMetaRequest(Buffer.from([0xff, 0x00, 0xd9]), 'v12')).toThrow(HandshakeError);
  });

  // A map decodes to an object without a prototype, which String() cannot print:
  // the error message must not be the thing that fails (fast-check found [{}, 0]).
  it.each([
    ['[{}, 0]', [0x92, 0x80, 0x00], 'v0.13'],
    ['[{}, 0, 0]', [0x93, 0x80, 0x00, 0x00], 'v12'],
    ['[{a: 2^64-1}, 0, 0]', [0x93, 0x81, 0xa1, 0x61, 0xcf, ...Array(8).fill(0xff), 0, 0], 'v12'],
    ['[[{}], 0, 0]', [0x93, 0x91, 0x80, 0x00, 0x00], 'v12'],
  ] as const)('a request whose message is %s: HandshakeError naming it', (_what, bytes, wire) => {
    for (const w of ['v12', 'v0.13'] as const) {
      let err: unknown;
      try {
        decodeMetaRequest(Buffer.from(bytes), w);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(HandshakeError);
      if (w === wire) expect((err as Error).message).toMatch(/unknown message [[{]/);
    }
  });

  it.each(vectors.v12.timestamp.map((v, i) => [i, v] as const))(
    'v12 reply timestamp %i is a msgpack float64',
    (_i, v) => {
      const frames = replyFrames(Buffer.from('p'), wireV12, v.seconds);
      expect(frames[1].toString('hex')).toBe(v.hex);
      expect(readReply(frames, wireV12).remoteSeconds).toBe(v.seconds);
    },
  );

  it('a reply with the wrong frame count names the profile the peer speaks', () => {
    expect(() => readReply([Buffer.from('p')], wireV12)).toThrow(/peer speaks v0.13/);
    expect(() => readReply(replyFrames(Buffer.from('p'), wireV12, 1), wireV013)).toThrow(/peer speaks v12/);
    expect(() => readReply([Buffer.from('p'), packMsgpack(null)], wireV12)).toThrow(/must be a msgpack number/);
  });
});

describe('compatibility hash', () => {
  it.each([...vectors.hash, ...vectors.v12.hash].map((v, i) => [i, v] as const))(
    'vector %i: json.dumps and sha256 match Python',
    (_i, v) => {
      expect(pyJsonDumps(v.factors as HashFactor)).toBe(v.json);
      expect(hashFactors(v.factors as { [k: string]: HashFactor })).toBe(v.sha256);
    },
  );

  it("computeCompatibilityHash: vLLM's 9 factors in v0.13, 12 in v12", () => {
    const f = vectors.hash[0].factors;
    const common = (x: typeof f) => ({
      vllmVersion: x.vllm_version,
      model: x.model,
      dtype: x.dtype,
      numKvHeads: x.num_kv_heads,
      headSize: x.head_size,
      numHiddenLayers: x.num_hidden_layers,
      attnBackendName: x.attn_backend_name,
      cacheDtype: x.cache_dtype,
    });
    expect(computeCompatibilityHash(common(f), 'v0.13')).toBe(vectors.hash[0].sha256);
    for (const v of vectors.v12.hash) {
      const g = v.factors;
      expect(
        computeCompatibilityHash(
          {
            ...common(g as never),
            isHmaEnabled: g.is_hma_enabled,
            speculativeConfig: g.speculative_config as never,
            transferMode: g.transfer_mode as 'pull',
          },
          'v12',
        ),
      ).toBe(v.sha256);
    }
    expect(() => computeCompatibilityHash(common(f), 'v12')).toThrow(/isHmaEnabled/);
    expect(() =>
      computeCompatibilityHash({ ...common(f), isHmaEnabled: false, transferMode: 'x' as 'pull' }, 'v12'),
    ).toThrow(/transferMode/);
  });
});

describe('kv_transfer_params', () => {
  const v12 = vectors.v12.kv_params[0];
  const v013 = vectors.kv_params[0];

  it('builders give exactly what vLLM returns, in both profiles', () => {
    const common = {
      remoteEngineId: 'prefill-engine',
      remoteRequestId: 'cmpl-abc-0',
      remoteHost: '10.0.0.7',
      remotePort: 5601,
      tpSize: 2,
      remoteBlockIds: [[1, 2, 3]],
    };
    expect(JSON.stringify(buildKvTransferParams({ ...common, remoteNumTokens: 40 }, 'v12'))).toBe(JSON.stringify(v12));
    expect(buildKvTransferParams(common, 'v0.13')).toEqual(v013);
    expect(() => buildKvTransferParams({ ...common, remoteBlockIds: [[1], [2]] }, 'v0.13')).toThrow(
      /one KV-cache group/,
    );
  });

  it('parsers read both, and name the shape of the other profile', () => {
    const p = parseKvTransferParams(v12, 'v12');
    expect(p).toMatchObject({ remoteBlockIds: [[1, 2, 3]], tpSize: 2, dcpSize: 1, ppSize: 1, transferMode: 'pull' });
    expect(parseKvTransferParams(v013, 'v0.13')).toMatchObject({ remoteBlockIds: [[1, 2, 3]], tpSize: 2, ppSize: 1 });
    expect(() => parseKvTransferParams(v013, 'v12')).toThrow(/flat list is vLLM v0.13/);
    expect(() => parseKvTransferParams(v12, 'v0.13')).toThrow(/one list per group is vLLM v12/);
    const { remote_host: _h, ...noHost } = v12;
    expect(() => parseKvTransferParams(noHost, 'v12')).toThrow(/missing required field 'remote_host'/);
    expect(() => parseKvTransferParams({ ...v12, remote_block_ids: [[]] }, 'v12')).toThrow(/empty/);
    expect(() => parseKvTransferParams({ ...v12, remote_port: '5601' }, 'v12')).toThrow(/remote_port/);
    expect(() => parseKvTransferParams({ ...v12, transfer_mode: 'teleport' }, 'v12')).toThrow(/transfer_mode/);
    // Read with defaults, as vLLM does.
    const { tp_size: _t, dcp_size: _d, pp_size: _p, ...minimal } = v12;
    expect(parseKvTransferParams(minimal, 'v12')).toMatchObject({ tpSize: 1, dcpSize: 1, ppSize: 1 });
    expect(parseKvTransferParams({ ...v12, remote_blocks_expiry_time: 1234.5 }, 'v12').remoteBlocksExpiryTime).toBe(
      1234.5,
    );
  });
});

describe('profile choice', () => {
  it('option, else NIXL_WIRE, else v12; a bad name is an error with a code', () => {
    const saved = process.env.NIXL_WIRE;
    try {
      delete process.env.NIXL_WIRE;
      expect(wireProfile().name).toBe('v12');
      process.env.NIXL_WIRE = 'v0.13';
      expect(wireProfile().name).toBe('v0.13');
      expect(wireProfile('v12').name).toBe('v12');
      process.env.NIXL_WIRE = 'v99';
      expect(() => wireProfile()).toThrow(
        expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM', message: expect.stringMatching(/NIXL_WIRE/) }),
      );
    } finally {
      if (saved === undefined) delete process.env.NIXL_WIRE;
      else process.env.NIXL_WIRE = saved;
    }
  });
});

describe('garbage never escapes as anything but a HandshakeError (fast-check)', () => {
  it('random bytes and mutated vectors, both profiles, every decoder', async () => {
    const fc = await import('fast-check');
    const seeds = [...vectors.v12.metadata.map((v) => v.hex), ...vectors.metadata.map((v) => v.hex)].map((h) =>
      Buffer.from(h, 'hex'),
    );
    const decoders = [
      (b: Buffer) => decodeAgentMetadata(b, 'v12'),
      (b: Buffer) => decodeAgentMetadata(b, 'v0.13'),
      (b: Buffer) => decodeMetaRequest(b, 'v12'),
      (b: Buffer) => decodeMetaRequest(b, 'v0.13'),
      (b: Buffer) => decodeHandshakePayload(b),
      (b: Buffer) => readReply([Buffer.from('p'), b], wireV12),
    ];
    const mutated = fc
      .tuple(
        fc.constantFrom(...seeds),
        fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 8 }),
        fc.nat(),
      )
      .map(([s, edits, cut]) => {
        const b = Buffer.from(s);
        for (const [at, v] of edits) b[at % b.length] = v;
        return b.subarray(0, b.length - (cut % 4 === 0 ? cut % b.length : 0));
      });
    fc.assert(
      fc.property(
        fc.oneof(
          fc.uint8Array({ maxLength: 64 }).map((u) => Buffer.from(u)),
          mutated,
        ),
        (b) => {
          for (const d of decoders) {
            try {
              d(b);
            } catch (e) {
              if (!(e instanceof HandshakeError)) throw e;
            }
          }
        },
      ),
      { numRuns: Number(process.env.FC_RUNS ?? 2000) },
    );
  });
});
