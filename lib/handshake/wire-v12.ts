// vLLM's NixlConnector format of today (NIXL_CONNECTOR_VERSION 12), as data
// (../shared/specs/vllm-side-channel.md, from vLLM's source).
//   request  msgpack [b"get_meta_msg", pp_rank, tp_rank]: anything else kills
//            vLLM's listener thread, so a client asks only for ranks that exist
//   reply    two frames: [NixlHandshakePayload, msgpack float64 monotonic s]
//   metadata 19 keys in field order, the first 12 required; layouts LBHNC...
//   hash     12 factors (adds is_hma_enabled, speculative_config, transfer_mode)
//   notif    "<request_id>:<notifications that prefill rank waits for>";
//            "HB:id1,id2" heartbeats extend a per-request lease (30 s)
//   params   per-group remote_block_ids, tp/dcp/pp sizes, transfer_mode
import { HandshakeError } from './errors';
import type { FieldSpec } from './fields';
import {
  KV_LAYOUTS,
  type KvLayoutName,
  type KvTransferParams,
  type NixlAgentMetadata,
  type WireProfile,
} from './model';

const OLD_FORMAT = 'a v0.13 (NixlConnector 2) peer does not send it';

const METADATA: readonly FieldSpec[] = [
  { key: 'engine_id', prop: 'engineId', type: 'str', required: true },
  { key: 'agent_metadata', prop: 'agentMetadata', type: 'bin', required: true },
  { key: 'kv_caches_base_addr', prop: 'kvCachesBaseAddr', type: 'u64[]', required: true },
  { key: 'device_id', prop: 'deviceId', type: 'int', required: true },
  { key: 'num_blocks', prop: 'numBlocks', type: 'int', required: true },
  { key: 'block_lens', prop: 'blockLens', type: 'int[]', required: true },
  { key: 'block_strides', prop: 'blockStrides', type: 'int[]', required: true, hint: OLD_FORMAT },
  { key: 'kv_cache_layout', prop: 'kvCacheLayout', type: 'str', required: true },
  { key: 'block_size', prop: 'blockSize', type: 'int', required: true },
  { key: 'ssm_sizes', prop: 'ssmSizes', type: 'int2', required: true, hint: OLD_FORMAT, default: [0, 0] },
  { key: 'attn_backend_name', prop: 'attnBackendName', type: 'str', required: true, hint: OLD_FORMAT },
  {
    key: 'physical_blocks_per_logical_kv_block',
    prop: 'physicalBlocksPerLogical',
    type: 'int',
    required: true,
    hint: OLD_FORMAT,
    default: 1,
  },
  { key: 'region_num_blocks', prop: 'regionNumBlocks', type: 'int[]', nullable: true, default: null },
  { key: 'region_group_ids', prop: 'regionGroupIds', type: 'int[]', nullable: true, default: null },
  { key: 'region_names', prop: 'regionNames', type: 'str[]', nullable: true, default: null },
  { key: 'region_mem_types', prop: 'regionMemTypes', type: 'str[]', nullable: true, default: null },
  { key: 'dcp_size', prop: 'dcpSize', type: 'int', default: 1 },
  { key: 'pcp_size', prop: 'pcpSize', type: 'int', default: 1 },
  { key: 'region_members', prop: 'regionMembers', type: 'str[][]', default: [] },
  // nixl-node's own, past vLLM's 19 (which vLLM ignores): where this prefill
  // rank publishes whether it still holds each request's blocks, [address,
  // slots] (lib/kv/lease-board.ts). Absent from vLLM's metadata.
  { key: 'nixl_node_lease_board', prop: 'nixlNodeLeaseBoard', type: 'u64[]', default: [], omitIfDefault: true },
  // The ucx_error_handling_mode of a nixl-node rank's UCX backend: a peer on
  // another cannot connect to it (lib/ucx.ts), and says so before loading.
  {
    key: 'nixl_node_ucx_error_handling_mode',
    prop: 'nixlNodeUcxErrorHandlingMode',
    type: 'str',
    default: '',
    omitIfDefault: true,
  },
];

const KV_PARAMS: readonly FieldSpec[] = [
  { key: 'do_remote_prefill', prop: 'doRemotePrefill', type: 'bool', default: false },
  { key: 'do_remote_decode', prop: 'doRemoteDecode', type: 'bool', default: false },
  {
    key: 'remote_block_ids',
    prop: 'remoteBlockIds',
    type: 'uint[][]',
    required: true,
    hint: 'v12 sends one list per KV-cache group; a flat list is vLLM v0.13 (NixlConnector 2)',
  },
  { key: 'remote_engine_id', prop: 'remoteEngineId', type: 'str', required: true },
  { key: 'remote_request_id', prop: 'remoteRequestId', type: 'str', required: true },
  { key: 'remote_host', prop: 'remoteHost', type: 'str', required: true },
  { key: 'remote_port', prop: 'remotePort', type: 'uint', required: true },
  { key: 'tp_size', prop: 'tpSize', type: 'uint', default: 1 },
  { key: 'dcp_size', prop: 'dcpSize', type: 'uint', default: 1 },
  { key: 'pp_size', prop: 'ppSize', type: 'uint', default: 1 },
  { key: 'remote_num_tokens', prop: 'remoteNumTokens', type: 'uint', nullable: true, default: null },
  { key: 'remote_blocks_expiry_time', prop: 'remoteBlocksExpiryTime', type: 'float', nullable: true, default: null },
  { key: 'transfer_mode', prop: 'transferMode', type: 'str', default: 'pull' },
];

/** vLLM's current wire format (NixlConnector version 12): clock offset, leases, pipeline ranks. */
export const wireV12: WireProfile = {
  name: 'v12',
  connectorVersion: 12,
  metadataFields: METADATA,
  layoutNames: Object.fromEntries(Object.keys(KV_LAYOUTS).map((k) => [k, k as KvLayoutName])),
  complete(d): NixlAgentMetadata {
    const layout = d.kvCacheLayout as string;
    if (!Object.hasOwn(KV_LAYOUTS, layout))
      throw new HandshakeError(
        `NixlAgentMetadata: kv_cache_layout '${layout.slice(0, 40)}' is not a v12 layout name (${Object.keys(KV_LAYOUTS).join(', ')})${layout === 'HND' || layout === 'NHD' ? '; HND/NHD are v0.13 names' : ''}`,
      );
    return d as unknown as NixlAgentMetadata;
  },
  requestRanks: ['pp_rank', 'tp_rank'],
  acceptsBareRequest: false,
  replyFrames: 2,
  hashFactors(f) {
    if (typeof f.isHmaEnabled !== 'boolean')
      throw new HandshakeError(
        `computeCompatibilityHash: v12 factor 'isHmaEnabled' must be a boolean (vLLM: not disable_hybrid_kv_cache_manager), got ${JSON.stringify(f.isHmaEnabled) ?? 'nothing'}`,
      );
    const mode = f.transferMode ?? 'pull';
    if (mode !== 'pull' && mode !== 'push')
      throw new HandshakeError(
        `computeCompatibilityHash: 'transferMode' must be 'pull' or 'push', got ${JSON.stringify(mode)}`,
      );
    const spec = f.speculativeConfig ?? null;
    if (spec !== null && (typeof spec !== 'object' || Array.isArray(spec)))
      throw new HandshakeError('computeCompatibilityHash: speculativeConfig must be null or a map');
    return {
      vllm_version: f.vllmVersion,
      nixl_connector_version: f.nixlConnectorVersion ?? 12,
      model: f.model,
      dtype: f.dtype,
      num_kv_heads: f.numKvHeads,
      head_size: f.headSize,
      num_hidden_layers: f.numHiddenLayers,
      attn_backend_name: f.attnBackendName,
      cache_dtype: f.cacheDtype,
      is_hma_enabled: f.isHmaEnabled,
      speculative_config: spec,
      transfer_mode: mode,
    };
  },
  notifSuffix: 'expected-count',
  heartbeats: true,
  defaultLeaseMs: 30_000,
  kvParamsFields: KV_PARAMS,
  toKvParams: (p: KvTransferParams) => ({ ...p }),
  fromKvParams(d): KvTransferParams {
    const mode = d.transferMode;
    if (mode !== 'pull' && mode !== 'push')
      throw new HandshakeError(
        `kv_transfer_params: transfer_mode must be 'pull' or 'push', got ${JSON.stringify(mode)}`,
      );
    return d as unknown as KvTransferParams;
  },
  transferModes: ['pull', 'push'],
  pushParamsOmit: ['dcp_size', 'remote_blocks_expiry_time'],
};
