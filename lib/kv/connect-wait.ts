// A pull's wait for its remote engine's connect. The connect is shared by
// every pull to that engine, so one pull giving up (aborted, or past its own
// handshake budget) stops waiting without cancelling it for the others.
import { NixlError } from '../errors';
import type { HandshakeBudget } from './pull-types';

/**
 * The longest a connect with `budget` can take: every attempt timing out with
 * its back-off between (as the handshake strategies retry), for the first rank
 * and then the others, plus a margin for loading agents.
 * @internal
 */
export function connectDeadlineMs(budget: HandshakeBudget): number {
  const attempts = 1 + (budget.retries ?? 2);
  let perRank = budget.timeoutMs * attempts;
  for (let i = 0; i + 1 < attempts; i++) perRank += Math.min(1000, 50 * 2 ** i);
  return 2 * perRank + 100;
}

/**
 * `connect`, unless `signal` aborts first (NIXL_ERR_CANCELED) or, with a
 * budget, it takes longer than the budget allows (NIXL_ERR_TIMEOUT).
 * @internal
 */
export function awaitConnect<T>(connect: Promise<T>, signal?: AbortSignal, budget?: HandshakeBudget): Promise<T> {
  if (!signal && !budget) return connect;
  return new Promise<T>((resolve, reject) => {
    const aborted = () =>
      new NixlError('pull aborted while it connected', 'NIXL_ERR_CANCELED', undefined, { cause: signal?.reason });
    if (signal?.aborted) {
      reject(aborted());
      return;
    }
    const onAbort = () => finish(() => reject(aborted()));
    const timer =
      budget &&
      setTimeout(
        () =>
          finish(() =>
            reject(
              new NixlError(
                `no connect within the pull's handshake budget (${budget.timeoutMs} ms per attempt)`,
                'NIXL_ERR_TIMEOUT',
              ),
            ),
          ),
        connectDeadlineMs(budget),
      );
    const finish = (f: () => void) => {
      if (timer) clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      f();
    };
    signal?.addEventListener('abort', onAbort, { once: true });
    connect.then(
      (v) => finish(() => resolve(v)),
      (e: unknown) => finish(() => reject(e)),
    );
  });
}
