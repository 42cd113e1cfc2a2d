// nixl-node/serving: the disaggregated-serving proxy, Node inference
// workers, the model boundary (the synthetic model, GGUF through
// node-llama-cpp) and fleets. The transports between proxy and workers and
// their ZeroMQ codec stay internal: a user picks one by name (`transport`).
export { ServingProxy, startProxy, type ProxyOptions } from './proxy/proxy';
export { startWorker } from './worker/start';
export { Worker } from './worker/worker';
export type { WorkerOptions } from './worker/options';
export type { WorkerStats } from './worker/stats';
export type { KvMode } from './worker/handoff';
export type { FrontHandler, RequestHints, Sink, WorkerRequest } from './worker/fronts/front';
export type { ProxyStats } from './proxy/metrics';
export type { Logger } from './log';
export type { Tamper } from './models/kv-state';
export type { WorkerPool, Policy, Stage, WorkerRef } from './proxy/pool';
export type { KvEventsOptions } from './kv-index/precise';
export type { DecodeLimits as KvEventLimits } from './kv-index/decode';
export type { IndexOptions as KvIndexOptions } from './kv-index/index';
export type { EventEndpoint as KvEventEndpoint } from './kv-index/subscriber';
export type { PromptTokenizer } from './kv-index/tokenizer';
export { HttpError } from './api/http';
export { TurnKv, type TurnDeps, type TurnStats, type Reuse, type HeldTurn, type TurnOwner } from './worker/turns';
export {
  CONVERSATION_KEY,
  type Conversations,
  type ConversationOptions,
  type ClaimedTurn,
} from './proxy/conversations';
export { SyntheticModel } from './models/synthetic';
export type { SyntheticModelSpec } from './models/synthetic-kv';
export { LlamaModel, type LlamaModelOptions } from './models/llama';
export type { LlamaStateLayout } from './models/llama/seq-state';
export {
  NODE_LLAMA_CPP,
  KvRejected,
  ModelRequestError,
  type ServingModel,
  type GenerationRequest,
  type Generated,
  type KvGeometry,
  type KvBinding,
  type KvInput,
  type PrefilledKv,
  type TurnKvState,
  type PreviousTurn,
  type ChatMessage,
  type BlockView,
  type TextSink,
  type ModelTokenizer,
  type PrefixCacheListener,
} from './models/types';
export { FleetRegistration, joinFleet, type FleetJoinOptions, type FleetMember } from './fleet/registry';
export { FleetDiscovery, type FleetWatchOptions } from './fleet/discovery';
export { type RoutingOptions, affinityKey, pickByLoad } from './fleet/routing';
export type { WorkerRecord, FleetRole, RecordKvEvents } from './fleet/record';
export type { EtcdOptions } from './fleet/etcd';
export type { KvEventsConfig, KvEventsInfo } from './worker/kv-events';
