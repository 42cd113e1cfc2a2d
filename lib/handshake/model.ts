// The profile-independent data (a data model, not an ML model) that
// everything above the wire works on (TP mapping, puller, tracker, proxy). A
// wire profile (wire-v0.13.ts, wire-v12.ts) maps it to and from one vLLM
// NixlConnector version; a later vLLM is one new profile file.
import type { FieldSpec } from './fields';
import type { HashFactor } from './py-json';

/**
 * vLLM's NixlAgentMetadata, as of connector version 12 (the richest format).
 * Decoding an older profile fills what it lacks with what it meant: strides
 * equal to block lens, one physical block per logical block, no SSM state.
 */
export interface NixlAgentMetadata {
  engineId: string;
  agentMetadata: Buffer;
  /** One per region. */
  kvCachesBaseAddr: bigint[];
  deviceId: number;
  /** Kernel-granularity blocks per region (unless regionNumBlocks says otherwise). */
  numBlocks: number;
  /** Bytes per block, per region. */
  blockLens: number[];
  /** Bytes from block b to block b+1, per region (>= block len). */
  blockStrides: number[];
  /** A name from KV_LAYOUTS. */
  kvCacheLayout: KvLayoutName;
  /** Tokens per kernel block. */
  blockSize: number;
  ssmSizes: [number, number];
  attnBackendName: string;
  physicalBlocksPerLogical: number;
  regionNumBlocks: number[] | null;
  regionGroupIds: number[] | null;
  regionNames: string[] | null;
  regionMemTypes: string[] | null;
  dcpSize: number;
  pcpSize: number;
  regionMembers: string[][];
  /**
   * nixl-node prefills only (v12, a key vLLM ignores): [address, slots] of
   * the lease board in its registered memory (lib/kv/lease-board.ts); empty
   * or absent otherwise.
   */
  nixlNodeLeaseBoard?: bigint[];
  /** nixl-node ranks on NIXL only (v12, a key vLLM ignores): their UCX backend's ucx_error_handling_mode. */
  nixlNodeUcxErrorHandlingMode?: string;
}

/** What a field means when a format does not carry it (a fresh object each call). */
export function absentMetadataFields(): Pick<
  NixlAgentMetadata,
  | 'ssmSizes'
  | 'physicalBlocksPerLogical'
  | 'regionNumBlocks'
  | 'regionGroupIds'
  | 'regionNames'
  | 'regionMemTypes'
  | 'dcpSize'
  | 'pcpSize'
  | 'regionMembers'
> {
  return {
    ssmSizes: [0, 0],
    physicalBlocksPerLogical: 1,
    regionNumBlocks: null,
    regionGroupIds: null,
    regionNames: null,
    regionMemTypes: null,
    dcpSize: 1,
    pcpSize: 1,
    regionMembers: [],
  };
}

/** What a caller must give to encode metadata: the rest has defaults. */
export type AgentMetadataInput = Pick<
  NixlAgentMetadata,
  'engineId' | 'agentMetadata' | 'kvCachesBaseAddr' | 'deviceId' | 'numBlocks' | 'blockLens' | 'blockSize'
> &
  Partial<Omit<NixlAgentMetadata, 'kvCacheLayout'>> & { kvCacheLayout: KvLayoutName | 'HND' | 'NHD' };

/**
 * vLLM's KVCacheLayout names (L layers, B blocks, H heads, N tokens, C
 * content: K and V packed). blockContiguous: one block of one layer is one
 * byte range, so a block is one descriptor. headsMajor: heads are the
 * outermost dimension inside a block, so a TP rank's heads are one slice
 * (what heterogeneous TP reads). v0.13's HND and NHD are LBHNC and LBNHC.
 */
export const KV_LAYOUTS = {
  LBHNC: { blockContiguous: true, headsMajor: true },
  LBNHC: { blockContiguous: true, headsMajor: false },
  BLHNC: { blockContiguous: true, headsMajor: true },
  BLNHC: { blockContiguous: true, headsMajor: false },
  LHBNC: { blockContiguous: false, headsMajor: true },
  BHLNC: { blockContiguous: false, headsMajor: true },
} as const;

/** A KV-cache layout name, as vLLM's kv_cache_layout. */
export type KvLayoutName = keyof typeof KV_LAYOUTS;

/** v0.13's names for the layouts it had. */
export const LEGACY_LAYOUT_NAMES: Readonly<Record<string, KvLayoutName>> = { HND: 'LBHNC', NHD: 'LBNHC' };

/** A layout name of either vocabulary, as the model's name; undefined if unknown. */
export function layoutName(s: unknown): KvLayoutName | undefined {
  if (typeof s !== 'string') return undefined;
  if (Object.hasOwn(KV_LAYOUTS, s)) return s as KvLayoutName;
  return LEGACY_LAYOUT_NAMES[s];
}

/** The factors of vLLM's compute_nixl_compatibility_hash. */
export interface CompatibilityFactors {
  vllmVersion: string;
  /** Default: the profile's connector version (2 for v0.13, 12 for v12). */
  nixlConnectorVersion?: number;
  model: string;
  dtype: string; // e.g. 'torch.bfloat16'
  numKvHeads: number;
  headSize: number;
  numHiddenLayers: number;
  attnBackendName: string;
  cacheDtype: string; // e.g. 'auto'
  /** v12: not scheduler_config.disable_hybrid_kv_cache_manager. Required for v12. */
  isHmaEnabled?: boolean;
  /** v12: null unless EAGLE-type speculation (a map of method, model, revision, ...). Default null. */
  speculativeConfig?: { [k: string]: HashFactor } | null;
  /** v12: 'pull' (default) or 'push'. */
  transferMode?: TransferMode;
}

/** kv_transfer_params as a prefill returns them and a decode reads them. */
export interface KvTransferParams {
  doRemotePrefill: boolean;
  doRemoteDecode: boolean;
  /** Logical block ids, one list per KV-cache group (v0.13 had one flat list: one group). */
  remoteBlockIds: number[][];
  remoteEngineId: string;
  remoteRequestId: string;
  remoteHost: string;
  /** Already includes the DP index. */
  remotePort: number;
  tpSize: number;
  dcpSize: number;
  ppSize: number;
  remoteNumTokens: number | null;
  /** Seconds on the prefill's clock; null from a normal prefill. */
  remoteBlocksExpiryTime: number | null;
  transferMode: TransferMode;
}

/** A side-channel request for one rank's metadata. */
export interface MetaRequest {
  /** undefined: v0.13's bare b"get_meta_msg" of the per-rank-port form. */
  tpRank: number | undefined;
  ppRank: number;
}

/** The vLLM NixlConnector wire formats nixl-node speaks. */
export type WireName = 'v0.13' | 'v12';

/** One vLLM NixlConnector format: tables, plus the few rules that are not tables. */
export interface WireProfile {
  readonly name: WireName;
  /** vLLM's NIXL_CONNECTOR_VERSION. */
  readonly connectorVersion: number;
  /** NixlAgentMetadata keys in field order. */
  readonly metadataFields: readonly FieldSpec[];
  /** The layout names this format carries, wire name -> model name. */
  readonly layoutNames: Readonly<Record<string, KvLayoutName>>;
  /** Fills what this format lacks (after decoding) from what it carries. */
  complete(decoded: Record<string, unknown>): NixlAgentMetadata;
  /** Elements of the request array after the magic. */
  readonly requestRanks: readonly ('pp_rank' | 'tp_rank')[];
  /** Whether the bare b"get_meta_msg" (rank chosen by port) is part of the format. */
  readonly acceptsBareRequest: boolean;
  /** Reply frames: [payload] or [payload, msgpack float64 monotonic seconds]. */
  readonly replyFrames: 1 | 2;
  /** The hash factors, in vLLM's key names and order. */
  hashFactors(f: CompatibilityFactors): { [k: string]: HashFactor };
  /** What the number after ':' in a completion notification means. */
  readonly notifSuffix: 'decode-tp-size' | 'expected-count';
  /** Whether decode sends HB:id,... heartbeats and prefill holds leases. */
  readonly heartbeats: boolean;
  /** How long a prefill holds a request's blocks without a read (vLLM's default), ms. */
  readonly defaultLeaseMs: number;
  /** kv_transfer_params keys a prefill returns, in order. */
  readonly kvParamsFields: readonly FieldSpec[];
  /** The kv_transfer_params JSON a prefill returns, in this profile's keys. */
  toKvParams(p: KvTransferParams): Record<string, unknown>;
  /** Parses kv_transfer_params in this profile's keys. */
  fromKvParams(decoded: Record<string, unknown>): KvTransferParams;
  /** The transfer modes the format has: v0.13 pull only; v12 pull and push (NixlPushConnector). */
  readonly transferModes: readonly TransferMode[];
  /** kv_transfer_params keys a push prefill leaves out (vLLM's push scheduler sends no dcp_size or expiry). */
  readonly pushParamsOmit: readonly string[];
}

/** How KV moves: the decode READs (pull, NixlConnector) or the prefill WRITEs (push, NixlPushConnector). */
export type TransferMode = 'pull' | 'push';
