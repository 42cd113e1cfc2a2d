// A worker as the proxy tracks it: shared by the pools and the fleet's routing.
import type { RecordKvEvents } from '../fleet/record';

/** A stage of a disaggregated request. */
export type Stage = 'encode' | 'prefill' | 'decode';

/** A worker as the proxy tracks it. */
export interface WorkerRef {
  /** HTTP base URL or ZMQ address. */
  address: string;
  stage: Stage;
  healthy: boolean;
  outstanding: number;
  /** Consecutive failed health checks or requests. */
  failures: number;
  /** The model it serves, when its health answer said (nixl-node workers do). */
  model?: string;
  /** Every name it serves (model first; vLLM --served-model-name), when its health answer or record said. */
  models?: string[];
  /** Tokens of its model's context (prompt and answer), when its health answer said. */
  maxModelLen?: number;
  /** Its name in etcd, when the fleet brought it (not the command line). */
  fleet?: string;
  /** Where its KV is, when its health answer said it serves push mode (what a push decode is sent). */
  push?: { engineId: string; host: string; port: number; tpSize: number; ppSize: number };
  /** Where it publishes vLLM's KV events, as its health answer or etcd record last said (the precise policy follows them). */
  kvEvents?: RecordKvEvents;
  /** What it last reported through etcd. */
  reported?: { load: number; freeBlocks: number; totalBlocks: number };
}
