export { ServingProxy, startProxy, type ProxyOptions } from './proxy';
export { Worker, startWorker, type WorkerOptions, type WorkerStats } from './worker';
export { WorkerPool, type Policy, type Stage, type WorkerRef } from './pool';
export { HttpTransport, ZmqTransport, TransportError, type WorkerTransport } from './transports';
export { decodeMessage, encodeMessage, TAGS, type Tag } from './protocol';
export { HttpError } from './http';
export * as syntheticModel from './models/synthetic-kv';
export { SyntheticModel } from './models/synthetic';
export { LlamaModel, type LlamaModelOptions } from './models/llama';
export {
  NODE_LLAMA_CPP,
  KvRejected,
  ModelRequestError,
  type ServingModel,
  type GenerationRequest,
  type Generated,
  type KvGeometry,
  type PrefilledKv,
} from './models/types';
