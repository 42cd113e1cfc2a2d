// Byte-exact vectors made with Python's msgpack + json (test/vectors/make_vectors.py).
import { describe, expect, it } from 'vitest';
import vectors from './vectors/handshake.json';
import {
  GET_META_MSG,
  HandshakeError,
  computeCompatibilityHash,
  decodeAgentMetadata,
  decodeHandshakePayload,
  decodeMetaRequest,
  encodeAgentMetadata,
  encodeHandshakePayload,
  encodeMetaRequest,
  hashFactors,
  openHandshakePayload,
  packMsgpack,
  pyJsonDumps,
  type HashFactor,
  type NixlAgentMetadata,
} from '../lib/handshake/codec';

function fromVector(v: (typeof vectors.metadata)[number]): NixlAgentMetadata {
  return {
    engineId: v.engine_id,
    agentMetadata: Buffer.from(v.agent_metadata, 'hex'),
    kvCachesBaseAddr: v.kv_caches_base_addr.map(BigInt),
    deviceId: v.device_id,
    numBlocks: v.num_blocks,
    blockLens: v.block_lens,
    kvCacheLayout: v.kv_cache_layout as 'HND' | 'NHD',
    blockSize: v.block_size,
  };
}

describe('NixlAgentMetadata codec', () => {
  it.each(vectors.metadata.map((v, i) => [i, v] as const))('vector %i encodes byte-exact and decodes back', (_i, v) => {
    const m = fromVector(v);
    expect(encodeAgentMetadata(m).toString('hex')).toBe(v.hex);
    expect(decodeAgentMetadata(Buffer.from(v.hex, 'hex'))).toEqual(m);
  });

  it('never packs a 64-bit address as a float', () => {
    const m = { ...fromVector(vectors.metadata[0]), kvCachesBaseAddr: [0x7f3a00000000n] };
    const hex = encodeAgentMetadata(m).toString('hex');
    expect(hex).toContain('91cf00007f3a00000000'); // [uint64], not float64 (0xcb)
    expect(packMsgpack(2 ** 40).toString('hex')).toBe('cf0000010000000000');
    expect(() => packMsgpack(1.5)).toThrow(HandshakeError);
    expect(decodeAgentMetadata(encodeAgentMetadata(m)).kvCachesBaseAddr[0]).toBe(0x7f3a00000000n);
  });

  it('ignores unknown keys, rejects missing or mistyped keys with a clear error', () => {
    const base = fromVector(vectors.metadata[0]);
    const withExtra = packMsgpack(
      new Map<string, never>([
        ['engine_id', 'x' as never],
        ['agent_metadata', Buffer.from([1]) as never],
        ['kv_caches_base_addr', [1] as never],
        ['device_id', 0 as never],
        ['num_blocks', 1 as never],
        ['block_lens', [1] as never],
        ['kv_cache_layout', 'HND' as never],
        ['block_size', 16 as never],
        ['future_field', 'ignored' as never],
      ]),
    );
    expect(decodeAgentMetadata(withExtra).engineId).toBe('x');
    const without = (key: string, replace?: unknown) => {
      const entries = Object.entries({
        engine_id: base.engineId,
        agent_metadata: base.agentMetadata,
        kv_caches_base_addr: base.kvCachesBaseAddr,
        device_id: base.deviceId,
        num_blocks: base.numBlocks,
        block_lens: base.blockLens,
        kv_cache_layout: base.kvCacheLayout,
        block_size: base.blockSize,
      })
        .filter(([k]) => k !== key || replace !== undefined)
        .map(([k, v]) => [k, k === key ? replace : v]);
      return packMsgpack(new Map(entries as [string, never][]));
    };
    expect(() => decodeAgentMetadata(without('num_blocks'))).toThrow(/missing key 'num_blocks'/);
    expect(() => decodeAgentMetadata(without('engine_id', 5))).toThrow(/'engine_id' must be a string, got number/);
    expect(() => decodeAgentMetadata(without('kv_caches_base_addr', ['a']))).toThrow(/kv_caches_base_addr/);
    expect(() => decodeAgentMetadata(without('kv_cache_layout', 'XYZ'))).toThrow(/HND/);
    expect(() => decodeAgentMetadata(without('agent_metadata', 'str'))).toThrow(/must be bytes/);
    expect(() => decodeAgentMetadata(Buffer.from([0xc1]))).toThrow(HandshakeError);
    expect(() => decodeAgentMetadata(packMsgpack([1, 2]))).toThrow(/expected a msgpack map/);
  });
});

describe('NixlHandshakePayload', () => {
  it.each(vectors.payload.map((v, i) => [i, v] as const))('vector %i is byte-exact', (_i, v) => {
    const p = { compatibilityHash: v.compatibility_hash, agentMetadataBytes: Buffer.from(v.inner_hex, 'hex') };
    expect(encodeHandshakePayload(p).toString('hex')).toBe(v.hex);
    expect(decodeHandshakePayload(Buffer.from(v.hex, 'hex'))).toEqual(p);
  });

  it('checks the compatibility hash unless told not to', () => {
    const v = vectors.payload[0];
    const p = decodeHandshakePayload(Buffer.from(v.hex, 'hex'));
    expect(openHandshakePayload(p, v.compatibility_hash).engineId).toBe('prefill-0');
    expect(openHandshakePayload(p, undefined).engineId).toBe('prefill-0');
    expect(() => openHandshakePayload(p, 'f'.repeat(64))).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_MISMATCH' }),
    );
  });
});

describe('handshake request', () => {
  it.each(vectors.request.map((v, i) => [i, v] as const))('vector %i', (_i, v) => {
    const [a, b] = v.ranks;
    const enc = b === undefined ? encodeMetaRequest(a) : encodeMetaRequest(b, a);
    expect(enc.toString('hex')).toBe(v.hex);
    expect(decodeMetaRequest(Buffer.from(v.hex, 'hex'))).toEqual(
      b === undefined ? { tpRank: a, ppRank: undefined } : { tpRank: b, ppRank: a },
    );
  });

  it('accepts the bare per-rank-port form and rejects junk', () => {
    expect(decodeMetaRequest(GET_META_MSG)).toEqual({ tpRank: undefined });
    expect(() => decodeMetaRequest(packMsgpack([Buffer.from('other'), 0]))).toThrow(/unknown message/);
    expect(() => decodeMetaRequest(packMsgpack([GET_META_MSG, -1]))).toThrow(/tp_rank/);
    expect(() => decodeMetaRequest(packMsgpack([GET_META_MSG]))).toThrow(HandshakeError);
    expect(() => decodeMetaRequest(Buffer.from([0xff, 0x00, 0xd9]))).toThrow(HandshakeError);
  });
});

describe('compatibility hash', () => {
  it.each(vectors.hash.map((v, i) => [i, v] as const))('vector %i: json.dumps and sha256 match Python', (_i, v) => {
    expect(pyJsonDumps(v.factors as HashFactor)).toBe(v.json);
    expect(hashFactors(v.factors as { [k: string]: HashFactor })).toBe(v.sha256);
  });

  it("computeCompatibilityHash uses vLLM's factor names", () => {
    const f = vectors.hash[0].factors;
    expect(
      computeCompatibilityHash({
        vllmVersion: f.vllm_version,
        nixlConnectorVersion: f.nixl_connector_version,
        model: f.model,
        dtype: f.dtype,
        numKvHeads: f.num_kv_heads,
        headSize: f.head_size,
        numHiddenLayers: f.num_hidden_layers,
        attnBackendName: f.attn_backend_name,
        cacheDtype: f.cache_dtype,
      }),
    ).toBe(vectors.hash[0].sha256);
  });
});
