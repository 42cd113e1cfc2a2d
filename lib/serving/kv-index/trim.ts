// The block index's bounds: its maps keep their newest entries, the oldest going first.

/** Entries one trim deletes beyond what the cap requires: a decision's share of the work, not its tail. */
const TRIM_STEP = 128;

/**
 * Keeps a map within `cap` entries, the oldest going first. Over the cap, it
 * trims ahead, towards a tenth below it, at most TRIM_STEP entries more than
 * the cap requires: deleting one entry at a time from the front of a V8 Map
 * leaves holes that each later scan from the front walks again, and a tenth
 * at once (1,000 speculative entries) was one routing decision in thirty
 * taking 100 us more.
 */
export function trim<K, V>(m: Map<K, V>, cap: number, onDrop?: (k: K, v: V) => void): void {
  if (m.size <= cap) return;
  let n = Math.max(m.size - cap, Math.min(m.size - Math.floor(cap * 0.9), TRIM_STEP));
  for (const [k, v] of m) {
    if (n-- <= 0) break;
    m.delete(k);
    onDrop?.(k, v);
  }
}
