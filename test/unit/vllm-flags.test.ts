// vLLM's serve flags and VLLM_NIXL_* variables as nixl-node worker options
// (cli/vllm-flags.ts; issue 48.2): each maps to the option doing the same
// job, contradictions and bad input are errors with a code, and settings that
// mean something else here come back as notes.
import { describe, expect, it } from 'vitest';
import { applyVllmFlags, expandServedModelName, maxModelLen, parseKvTransferConfig } from '../../cli/vllm-flags';

describe('--kv-transfer-config', () => {
  it('NixlConnector is pull, NixlPushConnector push; kv_role, engine_id and the extra config keys map', () => {
    expect(parseKvTransferConfig('{"kv_connector":"NixlConnector","kv_role":"kv_both"}')).toEqual({
      kvMode: 'pull',
      role: 'both',
      notes: [],
    });
    const c = parseKvTransferConfig(
      JSON.stringify({
        kv_connector: 'NixlPushConnector',
        kv_role: 'kv_consumer',
        engine_id: 'decode-0',
        kv_buffer_device: 'cuda',
        kv_connector_extra_config: { kv_lease_duration: 20, backends: ['UCX'], enforce_handshake_compat: true },
      }),
    );
    expect(c).toMatchObject({ kvMode: 'push', role: 'decode', name: 'decode-0', leaseS: 20 });
    expect(c.notes).toEqual([expect.stringMatching(/kv_buffer_device has no meaning here/)]);
    expect(
      parseKvTransferConfig(
        '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":' +
          '{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":60,"kv_recompute_threshold":0,"other":1}}',
      ),
    ).toEqual({
      kvMode: 'pull',
      role: 'prefill',
      bidirectionalKv: true,
      decoderKvTtlS: 60,
      kvRecomputeThreshold: 0,
      notes: ['kv_connector_extra_config.other is not implemented here: ignored'],
    });
  });

  it.each([
    ['{kv_connector:', 'NIXL_ERR_INVALID_PARAM', /is not JSON/],
    ['[1]', 'NIXL_ERR_INVALID_PARAM', /must be a JSON object/],
    ['{"kv_role":"kv_both"}', 'NIXL_ERR_NOT_SUPPORTED', /kv_connector null is not supported/],
    [
      '{"kv_connector":"LMCacheConnectorV1"}',
      'NIXL_ERR_NOT_SUPPORTED',
      /"LMCacheConnectorV1" is not supported.*NixlConnector/,
    ],
    ['{"kv_connector":"NixlConnector","kv_role":"producer"}', 'NIXL_ERR_INVALID_PARAM', /kv_role must be/],
    ['{"kv_connector":"NixlConnector","kv_rol":"kv_both"}', 'NIXL_ERR_INVALID_PARAM', /unknown field 'kv_rol'/],
    [
      '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"kv_lease_duration":-1}}',
      'NIXL_ERR_INVALID_PARAM',
      /kv_lease_duration must be seconds/,
    ],
    [
      '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"bidirectional_kv_xfer":"yes"}}',
      'NIXL_ERR_INVALID_PARAM',
      /bidirectional_kv_xfer must be true or false/,
    ],
  ])('%s: %s', (json, code, message) => {
    let err: (Error & { code?: string }) | undefined;
    try {
      parseKvTransferConfig(json);
    } catch (e) {
      err = e as Error & { code?: string };
    }
    expect(err?.code).toBe(code);
    expect(err?.message).toMatch(message);
  });
});

describe('the other flags and the environment', () => {
  it('--served-model-name takes several names after one flag, as vLLM does', () => {
    expect(expandServedModelName(['--served-model-name', 'a', 'b', '--port', '0', '--served-model-name', 'c'])).toEqual(
      ['--served-model-name', 'a', '--served-model-name', 'b', '--port', '0', '--served-model-name', 'c'],
    );
  });

  it('--max-model-len reads as vLLM reads it and becomes --context-size', () => {
    expect([maxModelLen('4096'), maxModelLen('4k'), maxModelLen('4K'), maxModelLen('auto'), maxModelLen('-1')]).toEqual(
      [4096, 4000, 4096, undefined, undefined],
    );
    expect(() => maxModelLen('lots')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
    const v: Record<string, unknown> = { 'max-model-len': '2K', model: 'x.gguf' };
    expect(applyVllmFlags(v, {}).notes).toEqual([]);
    expect(v['context-size']).toBe('2048');
    // The same thing said twice, differently: an error, not a guess.
    expect(() => applyVllmFlags({ 'max-model-len': '2048', 'context-size': '4096' }, {})).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM', message: expect.stringMatching(/--context-size/) }),
    );
  });

  it('--kv-transfer-config fills in the nixl-node flags; a contradiction with one of them is an error', () => {
    const v: Record<string, unknown> = {
      'kv-transfer-config': JSON.stringify({
        kv_connector: 'NixlConnector',
        kv_role: 'kv_consumer',
        engine_id: 'd0',
        kv_connector_extra_config: { bidirectional_kv_xfer: true, decoder_kv_blocks_ttl: 60, kv_lease_duration: 20 },
      }),
    };
    const r = applyVllmFlags(v, {});
    expect(v).toMatchObject({
      'kv-mode': 'pull',
      name: 'd0',
      'bidirectional-kv': true,
      'decoder-kv-ttl': '60',
      'lease-ms': '20000',
    });
    expect(v.role).toBeUndefined(); // no --etcd: the proxy's lists give the role
    expect(r.notes).toEqual([expect.stringMatching(/kv_role kv_consumer: every worker can prefill and decode/)]);
    const withEtcd: Record<string, unknown> = {
      etcd: 'http://127.0.0.1:2379',
      'kv-transfer-config': '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
    };
    applyVllmFlags(withEtcd, {});
    expect(withEtcd.role).toBe('prefill');
    expect(() =>
      applyVllmFlags({ 'kv-mode': 'pull', 'kv-transfer-config': '{"kv_connector":"NixlPushConnector"}' }, {}),
    ).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM', message: expect.stringMatching(/--kv-mode/) }));
  });

  it('VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT place the side channel; the abort timeout is the v0.13 lease', () => {
    const v: Record<string, unknown> = { wire: 'v0.13' };
    const r = applyVllmFlags(v, {
      VLLM_NIXL_SIDE_CHANNEL_HOST: '127.0.0.1',
      VLLM_NIXL_SIDE_CHANNEL_PORT: '5600',
      VLLM_NIXL_ABORT_REQUEST_TIMEOUT: '120',
    });
    expect(r).toEqual({ sideChannelHost: '127.0.0.1', notes: [] });
    expect(v).toMatchObject({ 'side-channel-port': '5600', 'lease-ms': '120000' });
    // The flag wins over the variable, as a command line does over the environment.
    const given: Record<string, unknown> = { 'side-channel-port': '7000' };
    const r12 = applyVllmFlags(given, { VLLM_NIXL_SIDE_CHANNEL_PORT: '5600', VLLM_NIXL_ABORT_REQUEST_TIMEOUT: '480' });
    expect(given['side-channel-port']).toBe('7000');
    expect(given['lease-ms']).toBeUndefined();
    expect(r12.notes).toEqual([expect.stringMatching(/VLLM_NIXL_ABORT_REQUEST_TIMEOUT.*ignored/)]);
    expect(() => applyVllmFlags({}, { VLLM_NIXL_ABORT_REQUEST_TIMEOUT: 'soon' })).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
    expect(() => applyVllmFlags({}, { VLLM_NIXL_SIDE_CHANNEL_HOST: 'a b' })).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
  });

  it('--block-size sets the synthetic model tokens per block; a GGUF worker notes it has byte blocks', () => {
    expect(applyVllmFlags({ 'block-size': '32' }, {}).notes).toEqual([]);
    expect(applyVllmFlags({ 'block-size': '32', model: 'm.gguf' }, {}).notes).toEqual([
      expect.stringMatching(/--block-kib/),
    ]);
    expect(() => applyVllmFlags({ 'block-size': '0' }, {})).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
  });
});
