// The proxy's index of which worker holds which prefix block. Blocks are
// keyed by the proxy's own chain over token ids (as llm-d does), so it works
// whatever hash a publisher uses; each worker's engine hashes map to those
// keys for removals and tokenless (offload) stores. Bounded: at most
// `maxBlocksPerWorker` blocks a worker (its oldest go first) and
// `maxWorkers` workers. Lookup costs O(prompt blocks).
import type { KvEvent } from './decode';

/** The key of a block: a 53-bit chain over the parent's key and the block's token ids. */
export function blockKey(parent: number, tokens: ArrayLike<number>, from: number, to: number): number {
  let h1 = (0xdeadbeef ^ parent) >>> 0;
  let h2 = (0x41c6ce57 ^ Math.floor(parent / 0x100000000)) >>> 0;
  for (let i = from; i < to; i++) {
    const t = tokens[i];
    h1 = Math.imul(h1 ^ t, 2654435761);
    h2 = Math.imul(h2 ^ t, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507);
  h1 ^= Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507);
  h2 ^= Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return 4294967296 * (2097151 & h2) + (h1 >>> 0);
}

/** The chain's first parent: the LoRA adapter (or none) starts its own chain. */
export function rootKey(lora: string | null = null): number {
  if (lora === null) return 0;
  const b = Buffer.from(lora, 'utf8');
  return blockKey(1, b, 0, b.length);
}

/** The keys of a prompt's full blocks, in order. */
export function promptKeys(tokens: ArrayLike<number>, blockSize: number, lora: string | null = null): number[] {
  const keys: number[] = [];
  let parent = rootKey(lora);
  for (let i = 0; i + blockSize <= tokens.length; i += blockSize) {
    parent = blockKey(parent, tokens, i, i + blockSize);
    keys.push(parent);
  }
  return keys;
}

// Map keys and values are kept small integers (V8 Smis): a 53-bit key as a
// Map key or value is a heap number, one more cache miss a lookup, and the
// decision's lookups are its cost. A slot is the key's low 32 bits; its
// value holds the other 21 bits (checked on lookup, so no two keys are
// confused) and the best tier held.
const slotOf = (k: number) => k | 0;
const highOf = (k: number) => Math.floor(k / 0x100000000);
/** Tier codes, best first, and what a block in each is worth to a prefill (llm-d: gpu 1.0, cpu 0.8; others 0.5). */
const TIER_CODE: Record<string, number> = { GPU: 0, CPU: 1, CPU_PINNED: 1 };
const CODE_WEIGHT = [1, 0.8, 0.5];
const tierCode = (medium: string | null) => TIER_CODE[medium ?? 'GPU'] ?? 2;
const SPEC_TICK_MS = 100;

interface WorkerBlocks {
  /** Slot -> high bits * 4 + tier code, in insertion order: the oldest are evicted first. */
  keys: Map<number, number>;
  /** Engine hash -> own key. */
  engine: Map<bigint, number>;
  /** Slot -> expiry in SPEC_TICK_MS ticks: routing decisions not yet confirmed by an event. */
  spec: Map<number, number>;
}

/** Bounds of the proxy's block index. */
export interface IndexOptions {
  /** Blocks indexed per worker at most. */
  maxBlocksPerWorker?: number;
  /** Workers indexed at most. */
  maxWorkers?: number;
  /** How long a routing decision's speculative entry counts, ms (default 2000, as llm-d). */
  speculativeTtlMs?: number;
  /** Speculative entries per worker at most (default 10,000). */
  maxSpeculative?: number;
}

/** A worker's run of the prompt's leading blocks: how many, and their tier-weighted sum. */
export interface Match {
  blocks: number;
  weight: number;
}

/** What one apply() did, by outcome, for the metrics. */
export type ApplyCounts = Record<string, number>;

/**
 * Keeps a map within `cap` entries, the oldest going first. It trims a tenth
 * below the cap at once: deleting one entry at a time from the front of a
 * V8 Map leaves holes that each later scan from the front walks again.
 */
function trim<K, V>(m: Map<K, V>, cap: number, onDrop?: (k: K) => void): void {
  if (m.size <= cap) return;
  let n = m.size - Math.floor(cap * 0.9);
  for (const k of m.keys()) {
    if (n-- <= 0) break;
    m.delete(k);
    onDrop?.(k);
  }
}

/** Which worker holds which prompt prefix. */
export class KvBlockIndex {
  readonly #workers = new Map<string, WorkerBlocks>();
  readonly o: Required<IndexOptions>;
  #confirmed = 0;

  constructor(o: IndexOptions = {}) {
    this.o = { maxBlocksPerWorker: 1_000_000, maxWorkers: 1024, speculativeTtlMs: 2000, maxSpeculative: 10_000, ...o };
  }

  /**
   * Stored blocks that a routing decision had sent there (a speculative entry
   * the event confirmed): proof that the proxy keys prompts as the workers'
   * events do (same tokens, same block size).
   */
  get confirmed(): number {
    return this.#confirmed;
  }

  /** Blocks indexed, all workers together. */
  get size(): number {
    let n = 0;
    for (const w of this.#workers.values()) n += w.keys.size;
    return n;
  }

  get workers(): string[] {
    return [...this.#workers.keys()];
  }

  #worker(name: string): WorkerBlocks | undefined {
    let w = this.#workers.get(name);
    if (!w) {
      if (this.#workers.size >= this.o.maxWorkers) return undefined;
      w = { keys: new Map(), engine: new Map(), spec: new Map() };
      this.#workers.set(name, w);
    }
    return w;
  }

  /** The tier code a worker holds `key` at, if it does. */
  #held(w: WorkerBlocks, key: number): number | undefined {
    const v = w.keys.get(slotOf(key));
    return v !== undefined && v >>> 2 === highOf(key) ? v & 3 : undefined;
  }

  /** Marks `key` held at tier `code` (the best tier wins), as the youngest entry. */
  #hold(w: WorkerBlocks, key: number, code: number): void {
    const slot = slotOf(key);
    const had = this.#held(w, key);
    w.keys.delete(slot);
    w.keys.set(slot, highOf(key) * 4 + (had === undefined ? code : Math.min(had, code)));
  }

  /** Applies one worker's events in order; returns counts by outcome (applied, unknown_parent, ...). */
  apply(name: string, events: readonly KvEvent[], counts: ApplyCounts = {}): ApplyCounts {
    const bump = (k: string, n = 1) => {
      counts[k] = (counts[k] ?? 0) + n;
    };
    for (const e of events) {
      if (e.type === 'AllBlocksCleared') {
        this.drop(name);
        bump('applied');
        continue;
      }
      const w = this.#worker(name);
      if (!w) {
        bump('too_many_workers');
        continue;
      }
      if (e.type === 'BlockRemoved') {
        for (const h of e.blockHashes) {
          const key = w.engine.get(h);
          if (key === undefined) bump('unknown_block');
          else {
            w.engine.delete(h);
            if (this.#held(w, key) !== undefined) w.keys.delete(slotOf(key));
          }
        }
        bump('applied');
        continue;
      }
      const code = tierCode(e.medium);
      if (e.tokenIds.length === 0) {
        // Tokenless (an offload tier): only blocks whose tokens an earlier store gave.
        for (const h of e.blockHashes) {
          const key = w.engine.get(h);
          if (key === undefined) bump('unknown_block');
          else this.#hold(w, key, code);
        }
        bump('applied');
        continue;
      }
      let parent: number | undefined = e.parent === null ? rootKey(e.loraName) : w.engine.get(e.parent);
      if (parent === undefined) {
        bump('unknown_parent');
        continue;
      }
      for (let i = 0; i < e.blockHashes.length; i++) {
        parent = blockKey(parent, e.tokenIds, i * e.blockSize, (i + 1) * e.blockSize);
        w.engine.set(e.blockHashes[i], parent);
        this.#hold(w, parent, code);
        if (w.spec.delete(slotOf(parent))) this.#confirmed++;
      }
      trim(w.keys, this.o.maxBlocksPerWorker);
      trim(w.engine, this.o.maxBlocksPerWorker);
      bump('applied');
      bump('blocks', e.blockHashes.length);
    }
    return counts;
  }

  /** Forgets a worker's blocks (it left, restarted, or cleared its cache). */
  drop(name: string): void {
    this.#workers.delete(name);
  }

  /** Records that a prompt's blocks were just sent to `name`: they count for it until `speculativeTtlMs`. */
  speculate(name: string, keys: readonly number[], now = performance.now()): void {
    const w = this.#worker(name);
    if (!w) return;
    const until = Math.ceil((now + this.o.speculativeTtlMs) / SPEC_TICK_MS);
    // An entry sent again keeps its place in the trimming order (set() alone
    // updates in place): a delete per key would double the decision's map work,
    // and the TTL, not the order, is what retires entries.
    for (let j = 0; j < keys.length; j++) {
      if (this.#held(w, keys[j]) === undefined) w.spec.set(slotOf(keys[j]), until);
    }
    trim(w.spec, this.o.maxSpeculative);
  }

  /**
   * Per candidate worker, the length (blocks) of the longest run of the
   * prompt's leading blocks it holds and its tier-weighted sum, speculative
   * entries counting as GPU blocks until they expire. Each candidate stops at
   * its first miss: O(candidates + matched blocks).
   */
  match(keys: readonly number[], candidates: readonly string[], now = performance.now()): Map<string, Match> {
    const blocks = new Float64Array(candidates.length);
    const weight = new Float64Array(candidates.length);
    this.matchInto(keys, candidates, blocks, weight, now);
    return new Map(candidates.map((c, i) => [c, { blocks: blocks[i], weight: weight[i] }]));
  }

  /**
   * match() into the caller's arrays (index i: candidates[i]), allocating
   * nothing: the routing decision runs this for every prefill on every
   * request, and garbage made there is the decision's tail latency.
   */
  matchInto(
    keys: readonly number[],
    candidates: readonly string[],
    blocks: Float64Array,
    weight: Float64Array,
    now = performance.now(),
  ): void {
    const tick = now / SPEC_TICK_MS;
    for (let c = 0; c < candidates.length; c++) {
      let n = 0;
      let sum = 0;
      const w = this.#workers.get(candidates[c]);
      if (w)
        for (let j = 0; j < keys.length; j++) {
          const k = keys[j];
          const slot = slotOf(k);
          const v = w.keys.get(slot);
          if (v !== undefined && v >>> 2 === highOf(k)) sum += CODE_WEIGHT[v & 3];
          else if (w.spec.size > 0) {
            const until = w.spec.get(slot);
            if (until === undefined || until <= tick) break;
            sum += 1;
          } else break;
          n++;
        }
      blocks[c] = n;
      weight[c] = sum;
    }
  }

  /** Blocks a worker holds or was just sent (speculative entries, until trimmed): where new prefixes go least. */
  held(name: string): number {
    const w = this.#workers.get(name);
    return w ? w.keys.size + w.spec.size : 0;
  }

  /** Whether any event of the worker's left blocks in the index (speculative entries aside). */
  knows(name: string): boolean {
    return (this.#workers.get(name)?.keys.size ?? 0) > 0;
  }
}
