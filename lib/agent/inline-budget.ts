// Work done inline on the event loop's thread is bounded per turn of the
// loop. Transfers posted inline (inlinePostMaxBytes) copy on this thread, and
// their waits settle at once, as microtasks: a loop of `transfer(); await
// wait()` would never let the event loop turn, and a burst of posts would
// hold it for all their copies. So both happen inline only while such work
// has run for less than TURN_BUDGET_MS since the first of it in this turn;
// past it, posts go through the engine's thread and settlements wait for the
// next turn (setImmediate), released together there. One budget for the
// process: there is one loop.
import { performance } from 'node:perf_hooks';

const TURN_BUDGET_MS = 1;
// Small posts (transfers, a layer-wise sender's layers) may skip the clock
// until this many of their bytes were posted since it was last read: a clock
// read costs 50-80 ns on a shared machine, a 4 KiB post about 2 us on NIXL,
// and copying this much takes tens of microseconds, a few percent of the
// budget at most.
const CLOCK_EVERY_BYTES = 128 << 10;
let turnStart = -1;
let budgetGone = false;
let lateUsed = false;
let uncheckedBytes = 0;
let deferred: Array<() => void> = [];

function endTurn(): void {
  turnStart = -1;
  budgetGone = false;
  lateUsed = false;
  const d = deferred;
  deferred = [];
  for (const release of d) release();
}

/** Whether this turn of the loop may still do inline work. */
export function inlineBudgetLeft(): boolean {
  const now = performance.now();
  uncheckedBytes = 0;
  if (turnStart < 0) {
    turnStart = now;
    setImmediate(endTurn);
    return true;
  }
  if (now - turnStart < TURN_BUDGET_MS) return true;
  budgetGone = true;
  return false;
}

/**
 * inlineBudgetLeft for a post that moves at most `bytes` (a transfer, a
 * layer of a layered request; < 0: unknown): the clock is read once per
 * CLOCK_EVERY_BYTES of such posts, not at each.
 */
export function inlineBudgetLeftFor(bytes: number): boolean {
  if (turnStart >= 0 && !budgetGone && bytes >= 0 && uncheckedBytes + bytes <= CLOCK_EVERY_BYTES) {
    uncheckedBytes += bytes;
    return true;
  }
  return inlineBudgetLeft();
}

/**
 * How a transfer moving at most `bytes` (< 0: unknown) may be posted now,
 * the clock read as inlineBudgetLeftFor reads it: 'inline' while the budget lasts; once it
 * is spent, 'late' for the first post of the turn (posted inline all the
 * same, but reported unfinished, so that its waits settle at the next turn:
 * a loop of `transfer(); await wait()` yields to the event loop without a
 * trip through the engine's thread, a hop that costs tens of microseconds
 * where such a post costs a few), then 'engine' for the rest of the turn,
 * so that a burst of posts does not hold the loop for all its copies.
 * single: false for a post of several requests at once.
 */
export function inlinePostModeFor(bytes: number, single = true): 'inline' | 'late' | 'engine' {
  if (inlineBudgetLeftFor(bytes)) return 'inline';
  // A post of many requests (a layered one's layers) is never late: it
  // would copy all of them past the budget.
  if (lateUsed || !single) return 'engine';
  lateUsed = true;
  return 'late';
}

/** A promise settled now while the budget lasts, else at the next turn. */
export function settledNow(): Promise<void> {
  if (inlineBudgetLeft()) return Promise.resolve();
  return new Promise<void>((resolve) => deferred.push(resolve));
}
