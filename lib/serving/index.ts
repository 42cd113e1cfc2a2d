export { ServingProxy, startProxy, type ProxyOptions } from './proxy';
export { Worker, startWorker, type WorkerOptions, type WorkerStats } from './worker';
export { WorkerPool, type Policy, type Stage, type WorkerRef } from './pool';
export { HttpTransport, ZmqTransport, TransportError, type WorkerTransport } from './transports';
export { decodeMessage, encodeMessage, TAGS, type Tag } from './protocol';
export * as syntheticModel from './synthetic-model';
