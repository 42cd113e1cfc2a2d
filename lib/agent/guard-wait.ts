// Timeout and abort for a pending wait (a transfer's, a notification's).
import { NixlError, invalidParam } from '../errors';
import type { WaitOptions } from './types';

/** Arms timeout and abort for a pending promise; returns the disarm function. */
export function guardWait(opts: WaitOptions, reject: (e: Error) => void, remove: () => void, what: string): () => void {
  let timer: NodeJS.Timeout | undefined;
  const { signal, timeoutMs } = opts;
  const onAbort = (): void => {
    disarm();
    reject(new NixlError(`waiting for ${what} aborted`, 'NIXL_ERR_CANCELED', undefined, { cause: signal?.reason }));
  };
  const disarm = (): void => {
    if (timer) clearTimeout(timer);
    signal?.removeEventListener('abort', onAbort);
    remove();
  };
  if (signal?.aborted) {
    queueMicrotask(onAbort);
  } else {
    signal?.addEventListener('abort', onAbort, { once: true });
  }
  if (timeoutMs !== undefined) {
    if (!(timeoutMs >= 0)) throw invalidParam('timeoutMs must be >= 0');
    timer = setTimeout(() => {
      disarm();
      reject(new NixlError(`${what} timed out after ${timeoutMs} ms`, 'NIXL_ERR_TIMEOUT'));
    }, timeoutMs);
  }
  return disarm;
}
