// The block index's bounds: its maps keep their newest entries, the oldest going first.
import type { Holders } from './holders';
import type { OrderedIntMap } from './ordered-map';

/** Entries one trim deletes beyond what the cap requires: a decision's share of the work, not its tail. */
const TRIM_STEP = 128;

/**
 * How many of a map's oldest entries go: over the cap, it trims ahead,
 * towards a tenth below it, at most TRIM_STEP entries more than the cap
 * requires, so that a map at its cap is trimmed once in a while, not on
 * every insert, and no trim is long.
 */
export function excess(size: number, cap: number): number {
  if (size <= cap) return 0;
  return Math.max(size - cap, Math.min(size - Math.floor(cap * 0.9), TRIM_STEP));
}

/**
 * Keeps a map within `cap` entries, the oldest going first, each O(1) (its
 * oldest record). An entry that goes and has a record in `holders` (the inverted
 * side) loses it there too: every entry (`mask` -1) or those whose value
 * has a bit of `mask`. No callback, so that a decision's trim makes no
 * closure.
 */
export function trimOrdered(m: OrderedIntMap, cap: number, holders?: Holders, id = 0, mask = -1): void {
  for (let n = excess(m.size, cap); n > 0; n--) {
    const r = m.popOldest();
    const v = m.valueAt(r);
    if (holders && (mask === -1 || (v & mask) !== 0)) holders.delete(m.keyAt(r), id);
  }
}
