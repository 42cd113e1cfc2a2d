export { ServingProxy, startProxy, type ProxyOptions } from './proxy';
export { Worker, startWorker, type WorkerOptions, type WorkerStats } from './worker';
export { WorkerPool, type Policy, type Stage, type WorkerRef } from './pool';
export { HttpTransport, ZmqTransport, TransportError, type WorkerTransport } from './transports';
export { decodeMessage, encodeMessage, TAGS, type Tag } from './protocol';
export { HttpError } from './http';
export * as syntheticModel from './models/synthetic-kv';
export { SyntheticModel } from './models/synthetic';
export { LlamaModel, type LlamaModelOptions, NODE_LLAMA_CPP } from './models/llama';
export {
  KvRejected,
  ModelRequestError,
  type ServingModel,
  type GenerationRequest,
  type Generated,
  type KvGeometry,
  type PrefilledKv,
} from './models/types';
