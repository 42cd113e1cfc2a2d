// What tests do to a worker to make a fault happen on purpose: late
// answers, reused blocks, a clock that drifts, damaged KV. Never set in a
// deployment; `nixl-node worker --help` does not list their flags.
import type { Tamper } from '../models/kv-state';

/**
 * A worker's test hooks (WorkerOptions.testHooks).
 * @internal
 */
export interface TestHooks {
  /** A prefill answers (push: offers its blocks) only after this long, ms. */
  stallPrefillMs?: number;
  /** A pull decode starts its pull only after this long, ms. */
  stallDecodeMs?: number;
  /** Blocks of a prefill freed unread are overwritten at once (as a reused block would be). */
  poisonFreed?: boolean;
  /** This worker's monotonic clock runs this far ahead (negative: behind) of the process's, ms. */
  clockSkewMs?: number;
  /** GGUF: a prefill damages each state it puts into blocks, this way (a bidirectional decode, each turn it holds). */
  tamperKv?: Tamper;
}

/** Waits ms, or until signal aborts (never throws). */
export function stall(ms: number | undefined, signal: AbortSignal): Promise<void> {
  if (!ms) return Promise.resolve();
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(t);
      resolve();
    });
  });
}
