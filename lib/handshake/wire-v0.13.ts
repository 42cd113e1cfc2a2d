// vLLM v0.13's NixlConnector format (NIXL_CONNECTOR_VERSION 2), as data.
//   request  msgpack [b"get_meta_msg", tp_rank] (or the bare bytes, rank by port)
//   reply    one frame: NixlHandshakePayload
//   metadata 8 keys; layouts HND/NHD; K and V may be separate regions
//   hash     9 factors
//   notif    "<request_id>:<decode TP size>"; no heartbeats; blocks freed after
//            VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s) without a read
//   params   flat remote_block_ids, 8 keys
import { HandshakeError } from './errors';
import type { FieldSpec } from './fields';
import {
  LEGACY_LAYOUT_NAMES,
  type KvTransferParams,
  type NixlAgentMetadata,
  type WireProfile,
  absentMetadataFields,
} from './model';

const METADATA: readonly FieldSpec[] = [
  { key: 'engine_id', prop: 'engineId', type: 'str', required: true },
  { key: 'agent_metadata', prop: 'agentMetadata', type: 'bin', required: true },
  { key: 'kv_caches_base_addr', prop: 'kvCachesBaseAddr', type: 'u64[]', required: true },
  { key: 'device_id', prop: 'deviceId', type: 'uint', required: true },
  { key: 'num_blocks', prop: 'numBlocks', type: 'uint', required: true },
  { key: 'block_lens', prop: 'blockLens', type: 'uint[]', required: true },
  { key: 'kv_cache_layout', prop: 'kvCacheLayout', type: 'str', required: true },
  { key: 'block_size', prop: 'blockSize', type: 'uint', required: true },
];

const KV_PARAMS: readonly FieldSpec[] = [
  { key: 'do_remote_prefill', prop: 'doRemotePrefill', type: 'bool', default: false },
  { key: 'do_remote_decode', prop: 'doRemoteDecode', type: 'bool', default: false },
  {
    key: 'remote_block_ids',
    prop: 'remoteBlockIds',
    type: 'uint[]',
    required: true,
    hint: 'v0.13 sends one flat list; one list per group is vLLM v12',
  },
  { key: 'remote_engine_id', prop: 'remoteEngineId', type: 'str', required: true },
  { key: 'remote_host', prop: 'remoteHost', type: 'str', required: true },
  { key: 'remote_port', prop: 'remotePort', type: 'uint', required: true },
  { key: 'remote_request_id', prop: 'remoteRequestId', type: 'str', required: true },
  { key: 'tp_size', prop: 'tpSize', type: 'uint', default: 1 },
];

/** vLLM v0.13's wire format (NixlConnector version 2). */
export const wireV013: WireProfile = {
  name: 'v0.13',
  connectorVersion: 2,
  metadataFields: METADATA,
  layoutNames: LEGACY_LAYOUT_NAMES,
  complete(d): NixlAgentMetadata {
    const layout = LEGACY_LAYOUT_NAMES[d.kvCacheLayout as string];
    if (!layout)
      throw new HandshakeError(
        `NixlAgentMetadata: kv_cache_layout '${String(d.kvCacheLayout).slice(0, 40)}' is not a v0.13 layout (HND or NHD)`,
      );
    const lens = d.blockLens as number[];
    return {
      ...(d as unknown as NixlAgentMetadata),
      ...absentMetadataFields(),
      kvCacheLayout: layout,
      blockStrides: [...lens],
      attnBackendName: '',
    };
  },
  requestRanks: ['tp_rank'],
  acceptsBareRequest: true,
  replyFrames: 1,
  hashFactors: (f) => ({
    vllm_version: f.vllmVersion,
    nixl_connector_version: f.nixlConnectorVersion ?? 2,
    model: f.model,
    dtype: f.dtype,
    num_kv_heads: f.numKvHeads,
    head_size: f.headSize,
    num_hidden_layers: f.numHiddenLayers,
    attn_backend_name: f.attnBackendName,
    cache_dtype: f.cacheDtype,
  }),
  notifSuffix: 'decode-tp-size',
  heartbeats: false,
  defaultLeaseMs: 480_000,
  kvParamsFields: KV_PARAMS,
  toKvParams(p: KvTransferParams) {
    if (p.remoteBlockIds.length !== 1)
      throw new HandshakeError(
        `kv_transfer_params: v0.13 carries one KV-cache group, got ${p.remoteBlockIds.length} (use the v12 profile)`,
      );
    return { ...p, remoteBlockIds: p.remoteBlockIds[0] };
  },
  fromKvParams(d): KvTransferParams {
    return {
      ...(d as unknown as KvTransferParams),
      remoteBlockIds: [d.remoteBlockIds as number[]],
      dcpSize: 1,
      ppSize: 1,
      remoteNumTokens: null,
      remoteBlocksExpiryTime: null,
      transferMode: 'pull',
    };
  },
  transferModes: ['pull'],
  pushParamsOmit: [],
};
