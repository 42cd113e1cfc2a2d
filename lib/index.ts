export { NixlAgent, RegisteredMemory, DlistHandle, XferHandle, engines } from './agent';
export type {
  AgentOptions,
  BackendParams,
  EngineKind,
  Notif,
  NotifMsg,
  WaitOptions,
  XferOp,
  XferOptions,
  XferState,
} from './agent';
export { DescList, allocate } from './descriptors';
export type { MemType, MemoryLike, RawDesc } from './descriptors';
export { NixlError, Status } from './errors';
export type { NixlErrorCode } from './errors';
export * as handshake from './handshake';
export {
  buildKvTransferParams,
  computeCompatibilityHash,
  createHandshake,
  parseKvTransferParams,
  prefillRequestParams,
  wireProfile,
} from './handshake';
export type {
  CompatibilityFactors,
  KvTransferParams,
  NixlAgentMetadata,
  WireName,
  WireProfile,
  HandshakeServer,
  HandshakeStrategy,
  HandshakeMethod,
  FetchOptions,
  ServeOptions,
} from './handshake';
export * as kv from './kv';
export {
  KvPuller,
  PullError,
  PrefillTracker,
  servePrefill,
  planReads,
  targetRemoteRanks,
  tpRatio,
  registerKvMetrics,
} from './kv';
export type { KvLayout, KvMetricsOptions, PromRegistry, PullOptions, PullResult, RemoteEndpoint } from './kv';
export * as serving from './serving';
export { ServingProxy, Worker, startProxy, startWorker } from './serving';
export type { ProxyOptions, WorkerOptions } from './serving';
export {
  type SpanLike,
  type SpanOptions,
  type TraceContext,
  contextFromTraceparent,
  setTracing,
  startSpan,
} from './tracing';
export type { NativeTelemetry } from './native';
