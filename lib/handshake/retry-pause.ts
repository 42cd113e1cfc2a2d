// The pause between a handshake fetch's attempts: 50 ms doubling, at most 1 s,
// cut short by the caller's abort, so that an aborted fetch settles at once
// instead of when the pause would have ended.
import { setTimeout as sleep } from 'node:timers/promises';

/** Waits before attempt `i + 1` (i from 0); resolves early, without throwing, when `signal` aborts. */
export async function retryPause(i: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return;
  await sleep(Math.min(1000, 50 * 2 ** i), undefined, { signal }).catch(() => {});
}
