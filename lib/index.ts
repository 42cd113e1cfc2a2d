// nixl-node: the Agent API, and the names most programs need from the side
// channels, the KV path and serving. The rest of each is on its subpath:
// nixl-node/handshake, nixl-node/kv, nixl-node/serving.
export { NixlAgent, RegisteredMemory, DlistHandle, XferHandle, LayeredXferHandle, engines } from './agent';
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
export {
  buildKvTransferParams,
  computeCompatibilityHash,
  createHandshake,
  parseKvTransferParams,
  prefillRequestParams,
  TransferModeError,
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
export {
  KvPuller,
  KvPushReceiver,
  KvPushSender,
  PushError,
  PullError,
  PrefillTracker,
  servePrefill,
  planReads,
  targetRemoteRanks,
  tpRatio,
  registerKvMetrics,
} from './kv';
export type { KvLayout, KvMetricsOptions, PromRegistry, PullOptions, PullResult, RemoteEndpoint } from './kv';
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
