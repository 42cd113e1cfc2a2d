// Picks a wire profile (option, else NIXL_WIRE, else v12) and runs its
// tables: metadata, requests, replies, hash, kv_transfer_params. Nothing here
// knows a version; the profiles are the data.
import { Float64, type MpValue, packMsgpack, unpackMsgpack } from './msgpack';
import { GET_META_MSG, type HandshakePayload } from './payload';
import { HandshakeError } from './errors';
import { decodeFields, encodeFields, fieldsFromJson, fieldsToJson } from './fields';
import { hashFactors } from './py-json';
import {
  type AgentMetadataInput,
  type CompatibilityFactors,
  type KvTransferParams,
  type MetaRequest,
  type NixlAgentMetadata,
  type TransferMode,
  type WireName,
  type WireProfile,
  layoutName,
} from './model';
import { showValue } from '../show-value';
import { wireV013 } from './wire-v0.13';
import { wireV12 } from './wire-v12';

/** Every wire profile by name. */
export const WIRE_PROFILES: Readonly<Record<WireName, WireProfile>> = { 'v0.13': wireV013, v12: wireV12 };
/** The profile used when none is named and NIXL_WIRE is unset. */
export const DEFAULT_WIRE: WireName = 'v12';

/** The profile named (or given), else NIXL_WIRE, else v12. */
export function wireProfile(w?: WireName | WireProfile | string): WireProfile {
  if (typeof w === 'object' && w !== null) return w;
  const name = w ?? process.env.NIXL_WIRE ?? DEFAULT_WIRE;
  const p = Object.hasOwn(WIRE_PROFILES, name) ? WIRE_PROFILES[name as WireName] : undefined;
  if (!p)
    throw new HandshakeError(
      `wire profile '${name}'${w === undefined ? ' (NIXL_WIRE)' : ''}: expected ${Object.keys(WIRE_PROFILES).join(' or ')}`,
    );
  return p;
}

// ---- NixlAgentMetadata ------------------------------------------------------

function normalize(m: AgentMetadataInput, p: WireProfile): Record<string, unknown> {
  const layout = layoutName(m.kvCacheLayout);
  if (!layout) throw new HandshakeError(`kv_cache_layout '${String(m.kvCacheLayout)}' is not a known layout name`);
  const wireLayout = Object.entries(p.layoutNames).find(([, v]) => v === layout)?.[0];
  if (wireLayout === undefined)
    throw new HandshakeError(
      `layout ${layout} has no name in the ${p.name} format (${Object.keys(p.layoutNames).join(', ')})`,
    );
  return { ...m, blockStrides: m.blockStrides ?? m.blockLens, kvCacheLayout: wireLayout };
}

/** Encodes vLLM's NixlAgentMetadata in a profile. */
export function encodeAgentMetadata(m: AgentMetadataInput, wire?: WireName | WireProfile): Buffer {
  const p = wireProfile(wire);
  return packMsgpack(encodeFields(p.metadataFields, normalize(m, p), `NixlAgentMetadata (${p.name})`));
}

/** Decodes vLLM's NixlAgentMetadata in a profile; bad fields throw HandshakeError. */
export function decodeAgentMetadata(buf: Uint8Array, wire?: WireName | WireProfile): NixlAgentMetadata {
  const p = wireProfile(wire);
  const what = `NixlAgentMetadata (${p.name})`;
  return p.complete(decodeFields(p.metadataFields, unpackMsgpack(buf, what), what));
}

/** The metadata as JSON with the profile's keys (the HTTP side channel's agent_metadata). */
export function agentMetadataToJson(m: NixlAgentMetadata, wire?: WireName | WireProfile): Record<string, unknown> {
  const p = wireProfile(wire);
  return fieldsToJson(p.metadataFields, normalize(m, p));
}

/** NixlAgentMetadata from the HTTP side channel's JSON. */
export function agentMetadataFromJson(o: unknown, wire?: WireName | WireProfile): NixlAgentMetadata {
  const p = wireProfile(wire);
  const what = `agent_metadata (${p.name})`;
  return p.complete(fieldsFromJson(p.metadataFields, o, what));
}

/**
 * A pull engine and a push engine met (their compatibility hashes differ in
 * transfer_mode alone): they never handshake (vLLM refuses too).
 */
export class TransferModeError extends HandshakeError {
  constructor(
    readonly localMode: TransferMode,
    readonly remoteMode: TransferMode,
  ) {
    super(
      `transfer mode mismatch: this engine moves KV by ${localMode} and the peer by ${remoteMode} ` +
        `(${remoteMode === 'push' ? 'NixlPushConnector: the prefill WRITEs' : 'NixlConnector: the decode READs'}); ` +
        'pull and push engines never handshake: run both in one mode (--kv-mode)',
      'NIXL_ERR_MISMATCH',
    );
    this.name = 'TransferModeError';
  }
}

/** Checks the hash (unless expected is undefined) and decodes the inner metadata. */
export function openHandshakePayload(
  payload: HandshakePayload,
  expectedHash: string | undefined,
  wire?: WireName | WireProfile,
): NixlAgentMetadata {
  checkCompatibilityHash(payload.compatibilityHash, expectedHash);
  return decodeAgentMetadata(payload.agentMetadataBytes, wire);
}

/**
 * Throws unless the peer's hash is the expected one (undefined: no check):
 * TransferModeError when the two differ in transfer mode alone (the
 * expected hash was computed by computeCompatibilityHash in this process),
 * else HandshakeError NIXL_ERR_MISMATCH.
 */
export function checkCompatibilityHash(remote: string, expectedHash: string | undefined): void {
  if (expectedHash === undefined || remote === expectedHash) return;
  const other = otherModeOf(expectedHash);
  if (other && other.hash === remote) throw new TransferModeError(other.local, other.remote);
  throw new HandshakeError(
    `compatibility hash mismatch: remote ${remote}, local ${expectedHash} ` +
      '(different vLLM or connector version, model, dtype, attention backend, HMA or transfer mode)',
    'NIXL_ERR_MISMATCH',
  );
}

// ---- side-channel requests and replies --------------------------------------

/** The side-channel request for one rank's payload. */
export function encodeMetaRequest(tpRank: number, ppRank = 0, wire?: WireName | WireProfile): Buffer {
  const p = wireProfile(wire);
  if (p.requestRanks.length === 1 && ppRank !== 0)
    throw new HandshakeError(`the ${p.name} request carries no pp_rank (asked for pp_rank ${ppRank})`);
  const ranks = p.requestRanks.map((r) => (r === 'pp_rank' ? ppRank : tpRank));
  return packMsgpack([GET_META_MSG, ...ranks]);
}

/** Reads a request; a shape of another profile is refused with a message that names it. */
export function decodeMetaRequest(buf: Uint8Array, wire?: WireName | WireProfile): MetaRequest {
  const p = wireProfile(wire);
  if (Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength).equals(GET_META_MSG)) {
    if (p.acceptsBareRequest) return { tpRank: undefined, ppRank: 0 };
    throw new HandshakeError(
      `handshake request: the bare get_meta_msg is v0.13's per-rank-port form; this side channel speaks ${p.name}`,
      'NIXL_ERR_MISMATCH',
    );
  }
  const v = unpackMsgpack(buf, 'handshake request');
  const shape = `[get_meta_msg, ${p.requestRanks.join(', ')}]`;
  if (!Array.isArray(v)) throw new HandshakeError(`handshake request: expected ${shape}`);
  if (v.length !== 1 + p.requestRanks.length) {
    const other = Object.values(WIRE_PROFILES).find((o) => o.requestRanks.length + 1 === v.length);
    throw new HandshakeError(
      `handshake request of ${v.length} elements: this side channel speaks ${p.name} (${shape})` +
        (other ? `; ${v.length} elements is the ${other.name} format` : ''),
      other ? 'NIXL_ERR_MISMATCH' : 'NIXL_ERR_INVALID_PARAM',
    );
  }
  const msg = v[0];
  const isGet = (msg instanceof Uint8Array && Buffer.from(msg).equals(GET_META_MSG)) || msg === 'get_meta_msg';
  if (!isGet) throw new HandshakeError(`handshake request: unknown message ${showValue(msg, 64)}`);
  const out: MetaRequest = { tpRank: 0, ppRank: 0 };
  p.requestRanks.forEach((name, i) => {
    const r = v[i + 1];
    if (typeof r !== 'number' || !Number.isInteger(r) || r < 0 || r > 65535)
      throw new HandshakeError(`handshake request: ${name} must be an int in 0..65535`);
    if (name === 'pp_rank') out.ppRank = r;
    else out.tpRank = r;
  });
  return out;
}

/** The frames a server sends after the identity (and delimiter). */
export function replyFrames(payload: Buffer, wire: WireProfile, nowSeconds: number): Buffer[] {
  return wire.replyFrames === 2 ? [payload, packMsgpack(new Float64(nowSeconds))] : [payload];
}

/** An error answer in the profile's frame count, so the client reads it instead of failing on the shape. */
export function errorFrames(message: string, code: string, wire: WireProfile, nowSeconds: number): Buffer[] {
  return replyFrames(
    packMsgpack(
      new Map<string, MpValue>([
        ['error', message],
        ['code', code],
      ]),
    ),
    wire,
    nowSeconds,
  );
}

/** Splits a reply into the payload and the server's clock (seconds), naming a profile mismatch. */
export function readReply(frames: Buffer[], wire: WireProfile): { payload: Buffer; remoteSeconds: number | undefined } {
  if (frames.length !== wire.replyFrames) {
    const other = Object.values(WIRE_PROFILES).find((o) => o.replyFrames === frames.length);
    // The peer's own error message says more than the frame count.
    const first = frames[0] ? tryError(frames[0]) : undefined;
    throw new HandshakeError(
      `side-channel reply of ${frames.length} frame(s): this client speaks ${wire.name} (${wire.replyFrames} frame(s))` +
        (other
          ? `; the peer speaks ${other.name} (NixlConnector ${other.connectorVersion}): set the wire profile to ${other.name}`
          : '') +
        (first ? `; the peer said: ${first}` : ''),
      'NIXL_ERR_MISMATCH',
    );
  }
  if (wire.replyFrames === 1) return { payload: frames[0], remoteSeconds: undefined };
  const t = unpackMsgpack(frames[1], 'reply timestamp');
  const seconds = t instanceof Float64 ? t.value : typeof t === 'number' ? t : undefined;
  if (seconds === undefined || !Number.isFinite(seconds))
    throw new HandshakeError('side-channel reply: the second frame must be a msgpack number (the peer clock)');
  return { payload: frames[0], remoteSeconds: seconds };
}

function tryError(frame: Buffer): string | undefined {
  try {
    const o = unpackMsgpack(frame, 'reply') as Record<string, unknown>;
    return typeof o === 'object' && o !== null && typeof o.error === 'string' ? o.error : undefined;
  } catch {
    return undefined;
  }
}

// ---- compatibility hash -----------------------------------------------------

const FACTOR_TYPES: Record<string, 'string' | 'number'> = {
  vllmVersion: 'string',
  nixlConnectorVersion: 'number',
  model: 'string',
  dtype: 'string',
  numKvHeads: 'number',
  headSize: 'number',
  numHiddenLayers: 'number',
  attnBackendName: 'string',
  cacheDtype: 'string',
};

/**
 * Hashes computed here, with the hash of the same factors in the other
 * transfer mode: a mismatch against exactly that one is a pull/push mismatch
 * and says so (TransferModeError). Bounded: engines compute a few.
 */
const OTHER_MODE = new Map<string, { hash: string; local: TransferMode; remote: TransferMode }>();

function otherModeOf(hash: string): { hash: string; local: TransferMode; remote: TransferMode } | undefined {
  return OTHER_MODE.get(hash);
}

function rememberModes(f: CompatibilityFactors, p: WireProfile, hash: string): void {
  if (OTHER_MODE.has(hash) || !p.transferModes.includes('push')) return;
  const local = f.transferMode ?? 'pull';
  const remote: TransferMode = local === 'pull' ? 'push' : 'pull';
  if (OTHER_MODE.size >= 256) OTHER_MODE.delete(OTHER_MODE.keys().next().value as string);
  OTHER_MODE.set(hash, { hash: hashFactors(p.hashFactors({ ...f, transferMode: remote })), local, remote });
}

/** vLLM's compute_nixl_compatibility_hash for the profile (default: NIXL_WIRE, else v12). */
export function computeCompatibilityHash(f: CompatibilityFactors, wire?: WireName | WireProfile): string {
  if (typeof f !== 'object' || f === null)
    throw new HandshakeError('computeCompatibilityHash expects the factors object');
  for (const [k, t] of Object.entries(FACTOR_TYPES)) {
    const v = (f as unknown as Record<string, unknown>)[k];
    if (v === undefined && k === 'nixlConnectorVersion') continue;
    if (typeof v !== t || (t === 'number' && !Number.isInteger(v))) {
      throw new HandshakeError(
        `computeCompatibilityHash: factor '${k}' must be ${t === 'number' ? 'an integer' : 'a string'}, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`,
      );
    }
  }
  const p = wireProfile(wire);
  const mode = f.transferMode ?? 'pull';
  // (A value that is no mode at all is the profile's to name.)
  if ((mode === 'pull' || mode === 'push') && !p.transferModes.includes(mode))
    throw new HandshakeError(
      `computeCompatibilityHash: transfer mode '${mode}' is not part of the ${p.name} format (${p.transferModes.join(', ')} only; vLLM added push in NixlConnector 7)`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  const hash = hashFactors(p.hashFactors(f));
  rememberModes(f, p, hash);
  return hash;
}

// ---- kv_transfer_params -----------------------------------------------------

/** kv_transfer_params as a prefill returns them (plain JSON, the profile's keys). */
export function buildKvTransferParams(
  p: Omit<
    KvTransferParams,
    | 'doRemotePrefill'
    | 'doRemoteDecode'
    | 'dcpSize'
    | 'ppSize'
    | 'remoteNumTokens'
    | 'remoteBlocksExpiryTime'
    | 'transferMode'
  > &
    Partial<KvTransferParams>,
  wire?: WireName | WireProfile,
): Record<string, unknown> {
  const prof = wireProfile(wire);
  const full: KvTransferParams = {
    doRemotePrefill: true,
    doRemoteDecode: false,
    dcpSize: 1,
    ppSize: 1,
    remoteNumTokens: null,
    remoteBlocksExpiryTime: null,
    transferMode: 'pull',
    ...p,
  };
  const what = `kv_transfer_params (${prof.name})`;
  if (!prof.transferModes.includes(full.transferMode))
    throw new HandshakeError(
      `${what}: transfer_mode '${full.transferMode}' is not part of the ${prof.name} format (vLLM added push in NixlConnector 7; use v12)`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  // Checks every value by the table, then emits JSON.
  encodeFields(prof.kvParamsFields, prof.toKvParams(full) as unknown as Record<string, unknown>, what);
  const json = fieldsToJson(prof.kvParamsFields, prof.toKvParams(full) as unknown as Record<string, unknown>);
  // vLLM's push scheduler returns the pull keys less these.
  if (full.transferMode === 'push') for (const k of prof.pushParamsOmit) delete json[k];
  return json;
}

/** Reads kv_transfer_params as a decode gets them; errors name the key and what came. */
export function parseKvTransferParams(o: unknown, wire?: WireName | WireProfile): KvTransferParams {
  const prof = wireProfile(wire);
  const p = prof.fromKvParams(fieldsFromJson(prof.kvParamsFields, o, `kv_transfer_params (${prof.name})`));
  if (p.remoteBlockIds.length === 0 || p.remoteBlockIds.every((g) => g.length === 0))
    throw new HandshakeError(`kv_transfer_params (${prof.name}): remote_block_ids is empty`);
  for (const k of ['tpSize', 'dcpSize', 'ppSize'] as const)
    if (p[k] < 1) throw new HandshakeError(`kv_transfer_params (${prof.name}): ${k} must be >= 1, got ${p[k]}`);
  if (p.remotePort < 1 || p.remotePort > 65535)
    throw new HandshakeError(`kv_transfer_params (${prof.name}): remote_port ${p.remotePort} is not a port`);
  return p;
}

/** What a proxy sends a prefill worker (vLLM's disagg proxy): produce KV for a remote decode. */
export function prefillRequestParams(): Record<string, unknown> {
  return {
    do_remote_decode: true,
    do_remote_prefill: false,
    remote_engine_id: null,
    remote_block_ids: null,
    remote_host: null,
    remote_port: null,
  };
}

/** Whether kv_transfer_params sent to a prefill name a previous turn to read (vLLM's test: non-empty remote_block_ids). */
export function namesPreviousTurn(kvp: Record<string, unknown> | undefined): boolean {
  const ids = kvp?.remote_block_ids;
  return Array.isArray(ids) && ids.length > 0 && (!Array.isArray(ids[0]) || ids[0].length > 0);
}
