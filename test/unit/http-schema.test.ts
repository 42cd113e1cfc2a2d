// The HTTP side channel's JSON against its published schema
// (docs/side-channel-http.schema.json), in both wire profiles.
import Ajv from 'ajv';
import { describe, expect, it } from 'vitest';
import schema from '../../docs/side-channel-http.schema.json';
import { HttpHandshake, type WireName, encodeAgentMetadata } from '../../lib/handshake';

const validate = new Ajv({ allErrors: true, strict: false }).compile(schema);

async function serveBoth(wire: WireName) {
  const h = new HttpHandshake();
  const pps = wire === 'v12' ? [0, 1] : [0];
  const payloads = pps.flatMap((pp) =>
    [0, 1].map((tp) => ({
      ppRank: pp,
      tpRank: tp,
      payload: {
        compatibilityHash: 'c'.repeat(64),
        agentMetadataBytes: encodeAgentMetadata(
          {
            engineId: 'P',
            agentMetadata: Buffer.from(`md-${pp}-${tp}`),
            kvCachesBaseAddr: [4096n, (1n << 64n) - 4096n],
            deviceId: tp,
            numBlocks: 64,
            blockLens: [8192, 8192],
            kvCacheLayout: 'LBHNC',
            blockSize: 16,
            attnBackendName: 'FLASH_ATTN',
            regionNames: wire === 'v12' ? ['layers.0', 'layers.1'] : undefined,
          },
          wire,
        ),
      },
    })),
  );
  const s = await h.serve({ port: 0, payloads, wire, logger: { warn() {} } });
  return { h, s };
}

describe.each(['v12', 'v0.13'] as const)('HTTP side channel JSON, wire %s', (wire) => {
  it('every answer validates against the schema; a tampered one does not', async () => {
    const { h, s } = await serveBoth(wire);
    try {
      const url = `http://127.0.0.1:${s.port}/get_kv_connector_metadata`;
      const bodies = [
        await (await fetch(url)).json(),
        await (await fetch(`${url}/0`)).json(),
        await (await fetch(`${url}/0/1`)).json(),
        ...(wire === 'v12' ? [await (await fetch(`${url}/0/1?pp_rank=1`)).json()] : []),
      ];
      for (const b of bodies) expect(validate(b), JSON.stringify(validate.errors)).toBe(true);
      const one = bodies[2];
      expect(one).toMatchObject({ wire, pp_rank: 0, tp_rank: 1 });
      for (const tamper of [
        { ...one, schema: 'nixl-node/side-channel/2' },
        { ...one, wire: wire === 'v12' ? 'v0.13' : 'v12' },
        { ...one, agent_metadata: { ...one.agent_metadata, kv_caches_base_addr: [1.5] } },
        { ...one, agent_metadata: { ...one.agent_metadata, extra: 1 } },
        { ...one, server_time: wire === 'v12' ? null : 1 },
      ]) {
        expect(validate(tamper)).toBe(false);
      }
      // The client reads what the schema describes.
      const got = await h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 1, ppRank: wire === 'v12' ? 1 : 0, wire });
      expect(got.metadata.kvCachesBaseAddr).toEqual([4096n, (1n << 64n) - 4096n]);
    } finally {
      h.close();
      await s.close();
    }
  });
});
