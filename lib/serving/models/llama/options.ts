// A GGUF model's options, apart from the code that reads them: this file's
// declarations name nothing of node-llama-cpp, so an application without it
// still type-checks against the package.
import { NixlError } from '../../../errors';

/** Options of a LlamaModel. */
export interface LlamaModelOptions {
  /** A GGUF file. */
  modelPath: string;
  /** CPU threads of each context (default: the cores, shared among `parallel` contexts). */
  threads?: number;
  /** Tokens of each context (default 4096, at most the model's trained length). */
  contextSize?: number;
  /** Requests evaluated at once, one context each (default 2). */
  parallel?: number;
  /** Tokens llama.cpp evaluates in one batch (default node-llama-cpp's: the context size, at most 512). */
  batchSize?: number;
  /**
   * Reuse the prompt an earlier request left in a context, in whole batches
   * (default true): the numbers are a fresh evaluation's.
   */
  prefixCache?: boolean;
  /** Bytes of one KV block of the worker's pool. */
  blockBytes: number;
  /** Bytes of the whole pool: the largest state a decode takes. */
  poolBytes: number;
  /** node-llama-cpp's GPU backend (default false: CPU). */
  gpu?: false | 'auto';
  /** The deployment's KV secret: states are sealed and checked with an HMAC keyed by it (else a checksum). */
  kvSecret?: string;
  /**
   * Where states go through files on their way in and out of llama.cpp
   * (default: NIXL_NODE_STATE_DIR, else /dev/shm where it is a writable
   * memory file system, else the OS temp dir).
   */
  stateDir?: string;
}

/** NIXL_ERR_INVALID_PARAM for a count that is not a positive integer. */
export function checkOptions(o: LlamaModelOptions): void {
  for (const k of ['threads', 'contextSize', 'parallel', 'batchSize'] as const) {
    const v = o[k];
    if (v !== undefined && (!Number.isInteger(v) || v < 1 || v > 1 << 20))
      throw new NixlError(`${k} must be a positive integer, got ${v}`, 'NIXL_ERR_INVALID_PARAM');
  }
}
