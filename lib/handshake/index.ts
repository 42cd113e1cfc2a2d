// nixl-node/handshake: vLLM's side channels (ZeroMQ, HTTP), its wire profiles,
// the agent metadata and kv_transfer_params codecs, the compatibility hash.
// The msgpack and field-table codec underneath stays internal.
import { HttpHandshake } from './http';
import type { HandshakeMethod, HandshakeStrategy } from './types';
import { zmqHandshake } from './zmq';
import { NixlError } from '../errors';

/**
 * The side channel for a method: the option, else NIXL_HANDSHAKE_METHOD
 * (zmq | http), else zmq. The wire profile is chosen per call (option, else
 * NIXL_WIRE, else v12).
 */
export function createHandshake(method?: HandshakeMethod, opts: { keepAlive?: boolean } = {}): HandshakeStrategy {
  const m = method ?? (process.env.NIXL_HANDSHAKE_METHOD as HandshakeMethod | undefined) ?? 'zmq';
  if (m === 'zmq') return zmqHandshake;
  if (m === 'http') return new HttpHandshake(opts.keepAlive ?? true);
  throw new NixlError(
    `handshake method '${m}': expected 'zmq' or 'http' (NIXL_HANDSHAKE_METHOD)`,
    'NIXL_ERR_INVALID_PARAM',
  );
}

export { HandshakeError } from './errors';
export type { FieldSpec, FieldType } from './fields';
export type { HashFactor } from './py-json';
export type { HandshakePayload } from './payload';
export { HttpHandshake, HTTP_SCHEMA } from './http';
export { zmqHandshake } from './zmq';
export { KV_LAYOUTS } from './model';
export type {
  AgentMetadataInput,
  CompatibilityFactors,
  KvLayoutName,
  KvTransferParams,
  NixlAgentMetadata,
  TransferMode,
  WireName,
  WireProfile,
} from './model';
export type {
  FetchOptions,
  FetchResult,
  HandshakeLogger,
  HandshakeMethod,
  HandshakeServer,
  HandshakeStrategy,
  RankPayload,
  ServeOptions,
  TlsClientOptions,
  TlsServerOptions,
} from './types';
export {
  DEFAULT_WIRE,
  WIRE_PROFILES,
  agentMetadataFromJson,
  agentMetadataToJson,
  buildKvTransferParams,
  computeCompatibilityHash,
  decodeAgentMetadata,
  encodeAgentMetadata,
  parseKvTransferParams,
  prefillRequestParams,
  TransferModeError,
  wireProfile,
} from './wire';
export { wireV013 } from './wire-v0.13';
export { wireV12 } from './wire-v12';
