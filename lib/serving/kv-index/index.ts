// The proxy's index of which worker holds which prefix block. Blocks are
// keyed by the proxy's own chain over token ids (as llm-d does), so it works
// whatever hash a publisher uses; each worker's engine hashes map to those
// keys for removals and tokenless (offload) stores. Bounded: at most
// `maxBlocksPerWorker` blocks a worker (its oldest go first) and
// `maxWorkers` workers. Each worker's map (what it holds, oldest first, for
// eviction and removals) has an inverted side for prompts' first blocks
// (first block -> the workers holding it, as llm-d keeps for every block),
// which every path that changes a worker's map keeps equal to it: a routing
// decision looks the prompt's first block up once, whatever the number of
// workers, and walks on only in the maps of the workers that hold it. Only
// first blocks: inverting every block made each update two more lookups in
// one map of all workers' blocks (cache misses), halving the update rate.
//
// Keys are over blocks of `keySize` tokens (the proxy's block size). A
// worker whose blocks are a whole multiple of it (a GGUF worker announces
// its batch size) has each block keyed as that many keys of the same chain,
// so a prompt is keyed once whatever the pool mixes; its engine hash finds
// them all (its parts in the engine map), and its match is floored to a
// whole number of its blocks: what it can reuse.
import type { KvEvent } from './decode';
import { Holders } from './holders';
import { blockKey, rootKey } from './keys';
import { OrderedIntMap } from './ordered-map';
import { EngineMap } from './engine-map';
import { excess, trimOrdered } from './trim';

export { blockKey, promptKeys, rootKey } from './keys';

// Map keys and values are int32 (OrderedIntMap's typed arrays; a 53-bit key
// would take two, and the decision's lookups are its cost). A slot is the
// key's low 32 bits; its value holds the other 21 bits (checked on lookup,
// so no two keys are confused), whether it is a prompt's first block (FIRST)
// and the best tier held: high * 8 + FIRST + tier code.
const slotOf = (k: number) => k | 0;
const FIRST = 4;
const highOf = (k: number) => Math.floor(k / 0x100000000);
/** Tier codes, best first, and what a block in each is worth to a prefill (llm-d: gpu 1.0, cpu 0.8; others 0.5). */
const TIER_CODE: Record<string, number> = { GPU: 0, CPU: 1, CPU_PINNED: 1 };
const CODE_WEIGHT = [1, 0.8, 0.5];
const tierCode = (medium: string | null) => TIER_CODE[medium ?? 'GPU'] ?? 2;
const SPEC_TICK_MS = 100;

interface WorkerBlocks {
  /** Its id in the inverted maps (reused once the worker is dropped). */
  id: number;
  /** Slot -> high bits * 8 + FIRST + tier code, in insertion order: the oldest are evicted first. */
  keys: OrderedIntMap;
  /** Engine hash -> own key. */
  engine: EngineMap;
  /** Slot -> expiry in SPEC_TICK_MS ticks: routing decisions not yet confirmed by an event, prompts' blocks after the first. */
  spec: OrderedIntMap;
  /**
   * The same for prompts' first blocks, mirrored in the inverted side. Apart
   * from `spec`, so that writing a decision's entries needs no read of what
   * a slot held before (a 32-bit slot of a later block may equal a first
   * block's).
   */
  specFirst: OrderedIntMap;
  /** Keys per block of its latest store (its block size over keySize): its match is floored to a multiple. */
  per: number;
  /** The most keys a block of its had: above 1, its blocks may have parts in the engine map. */
  maxPer: number;
}

/** Bounds of the proxy's block index. */
export interface IndexOptions {
  /** Blocks indexed per worker at most. */
  maxBlocksPerWorker?: number;
  /** Workers indexed at most. */
  maxWorkers?: number;
  /** How long a routing decision's speculative entry counts, ms (default 2000, as llm-d). */
  speculativeTtlMs?: number;
  /** Speculative entries per worker at most (default 10,000), for prompts' first blocks and for later blocks each. */
  maxSpeculative?: number;
  /** Keys one store may make at most, its blocks times keys per block (default 65,536, the hashes an event may carry). */
  maxKeysPerEvent?: number;
}

/** A worker's run of the prompt's leading blocks: how many, and their tier-weighted sum. */
export interface Match {
  blocks: number;
  weight: number;
}

/** A worker's maps as views() gives them: [slot, value] entries, oldest first. */
export interface WorkerView {
  id: number;
  keys: [number, number][];
  spec: [number, number][];
  specFirst: [number, number][];
}
type Tuple3 = [number, number, number];
type Stored = Extract<KvEvent, { type: 'BlockStored' }>;

/** What one apply() did, by outcome, for the metrics. */
export type ApplyCounts = Record<string, number>;

/** Which worker holds which prompt prefix. */
export class KvBlockIndex {
  readonly #workers = new Map<string, WorkerBlocks>();
  readonly o: Required<IndexOptions>;
  /** First block's slot -> workers holding it (payload: what their `keys` holds). */
  readonly #holders = new Holders();
  /** First block's slot -> workers with a speculative entry for it (payload: what their `specFirst` holds). */
  readonly #specHolders = new Holders();
  /** By worker id: the worker (ids are reused, so they stay below the most workers held at once). */
  readonly #byId: (WorkerBlocks | undefined)[] = [];
  /** Worker ids of dropped workers, for reuse. */
  readonly #freeIds: number[] = [];
  #nextId = 0;
  /** By worker id: the decision's candidate index + 1, 0 when not a candidate (zero between decisions). */
  #at = new Int32Array(64);
  /** By candidate index: its worker id, -1 when not indexed. */
  #candIds = new Int32Array(64);
  /** The candidates holding the prompt's first block. */
  #run = new Int32Array(64);
  #confirmed = 0;
  /**
   * Tokens per key (the proxy's block size): a store whose block size is a
   * whole multiple is keyed that many keys a block, another is dropped
   * (counted `block_size`). Unset: each store by its own block size.
   */
  keySize: number | undefined;

  constructor(o: IndexOptions = {}, keySize?: number) {
    this.o = {
      maxBlocksPerWorker: 1_000_000,
      maxWorkers: 1024,
      speculativeTtlMs: 2000,
      maxSpeculative: 10_000,
      maxKeysPerEvent: 65_536,
      ...o,
    };
    this.keySize = keySize;
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
      const id = this.#freeIds.pop() ?? this.#nextId++;
      if (id >= this.#at.length) {
        const at = new Int32Array(this.#at.length * 2);
        at.set(this.#at);
        this.#at = at;
      }
      w = {
        id,
        keys: new OrderedIntMap(),
        engine: new EngineMap(),
        spec: new OrderedIntMap(),
        specFirst: new OrderedIntMap(),
        per: 1,
        maxPer: 1,
      };
      this.#byId[id] = w;
      this.#workers.set(name, w);
    }
    return w;
  }

  /** The tier code a worker holds `key` at, if it does. */
  #held(w: WorkerBlocks, key: number): number | undefined {
    const v = w.keys.get(slotOf(key));
    return v >= 0 && v >>> 3 === highOf(key) ? v & 3 : undefined;
  }

  /**
   * Marks `key` held at tier `code` (the best tier wins), as the youngest
   * entry; `first`: a prompt's first block (a tokenless store keeps what the
   * block was).
   */
  #hold(w: WorkerBlocks, key: number, code: number, first: number): void {
    const slot = slotOf(key);
    const had = w.keys.get(slot);
    const same = had >= 0 && had >>> 3 === highOf(key);
    const f = same ? had & FIRST : first;
    const v = highOf(key) * 8 + f + (same ? Math.min(had & 3, code) : code);
    w.keys.setYoungest(slot, v);
    // A slot another key held (a 32-bit collision) may have been a first block.
    if (f !== 0) this.#holders.set(slot, w.id, v);
    else if (had >= 0 && had & FIRST) this.#holders.delete(slot, w.id);
  }

  /** Forgets the block in `slot` of a worker, both sides. */
  #unhold(w: WorkerBlocks, slot: number): void {
    const v = w.keys.get(slot);
    if (v < 0) return;
    w.keys.delete(slot);
    if (v & FIRST) this.#holders.delete(slot, w.id);
  }

  /** Forgets a speculative entry of a worker (a first block's: both sides); whether there was one. */
  #unspec(w: WorkerBlocks, slot: number, first: boolean): boolean {
    if (!first) return w.spec.delete(slot);
    if (!w.specFirst.delete(slot)) return false;
    this.#specHolders.delete(slot, w.id);
    return true;
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
      if (e.type === 'BlockRemoved') this.#remove(w, e.blockHashes, bump);
      else if (e.tokenIds.length === 0) this.#retier(w, e.blockHashes, tierCode(e.medium), bump);
      else this.#store(w, e, bump);
    }
    return counts;
  }

  /** A BlockRemoved: each block's keys go (its parts' too). */
  #remove(w: WorkerBlocks, hashes: readonly bigint[], bump: (k: string, n?: number) => void): void {
    for (const h of hashes) {
      const key = w.engine.get(h);
      if (key < 0) {
        bump('unknown_block');
        continue;
      }
      w.engine.delete(h);
      this.#release(w, key);
      if (w.maxPer > 1)
        for (let p = 0, k = w.engine.get(h, 0); k >= 0; k = w.engine.get(h, ++p)) {
          w.engine.delete(h, p);
          this.#release(w, k);
        }
    }
    bump('applied');
  }

  #release(w: WorkerBlocks, key: number): void {
    if (this.#held(w, key) !== undefined) this.#unhold(w, slotOf(key));
  }

  /** A tokenless store (an offload tier): only blocks whose tokens an earlier store gave, all their keys. */
  #retier(w: WorkerBlocks, hashes: readonly bigint[], code: number, bump: (k: string, n?: number) => void): void {
    for (const h of hashes) {
      const key = w.engine.get(h);
      if (key < 0) {
        bump('unknown_block');
        continue;
      }
      this.#hold(w, key, code, 0);
      if (w.maxPer > 1)
        for (let p = 0, k = w.engine.get(h, 0); k >= 0; k = w.engine.get(h, ++p)) this.#hold(w, k, code, 0);
    }
    bump('applied');
  }

  /** Keys per block of a store's block size: 1 at keySize (or with none set), 0 when not a whole multiple. */
  #perBlock(size: number): number {
    const b = this.keySize;
    if (b === undefined || size === b) return 1;
    return size > b && size % b === 0 ? size / b : 0;
  }

  /**
   * A BlockStored with tokens: each block is `per` keys of the chain, the
   * last one under its engine hash (the next store's parent), the others
   * under its parts, numbered back from it: set highest first, so that the
   * bound's trim (oldest first) leaves a block's parts 0..k, and a removal
   * walks them to the first missing one, at most as many lookups as keys it
   * removes. A hash stored again is the youngest again, as its keys are: an
   * entry older than the keys it names would be trimmed while they stay, and
   * a removal could no longer find them.
   */
  #store(w: WorkerBlocks, e: Stored, bump: (k: string, n?: number) => void): void {
    const per = this.#perBlock(e.blockSize);
    let parent = e.parent === null ? rootKey(e.loraName) : w.engine.get(e.parent);
    const bad =
      per === 0
        ? 'block_size'
        : e.blockHashes.length * per > this.o.maxKeysPerEvent
          ? 'too_large'
          : parent < 0
            ? 'unknown_parent'
            : undefined;
    if (bad !== undefined) {
      bump(bad);
      return;
    }
    const code = tierCode(e.medium);
    const size = e.blockSize / per;
    for (let i = 0, from = 0; i < e.blockHashes.length; i++) {
      const h = e.blockHashes[i];
      for (let j = 0; j < per; j++, from += size) {
        parent = blockKey(parent, e.tokenIds, from, from + size);
        if (j < per - 1) w.engine.set(h, parent, per - 2 - j, true);
        const first = i === 0 && j === 0 && e.parent === null;
        this.#hold(w, parent, code, first ? FIRST : 0);
        if (this.#unspec(w, slotOf(parent), first)) this.#confirmed++;
      }
      w.engine.set(h, parent, -1, true);
    }
    w.per = per;
    w.maxPer = Math.max(w.maxPer, per);
    trimOrdered(w.keys, this.o.maxBlocksPerWorker, this.#holders, w.id, FIRST);
    w.engine.dropOldest(excess(w.engine.size, this.o.maxBlocksPerWorker));
    bump('applied');
    bump('blocks', e.blockHashes.length);
  }

  /** Forgets every worker (the proxy's block size changed: every key does). */
  clear(): void {
    for (const name of [...this.#workers.keys()]) this.drop(name);
  }

  /** Forgets a worker's blocks (it left, restarted, or cleared its cache). */
  drop(name: string): void {
    const w = this.#workers.get(name);
    if (!w) return;
    for (const [slot, v] of w.keys.entries()) if (v & FIRST) this.#holders.delete(slot, w.id);
    for (const slot of w.specFirst.keys()) this.#specHolders.delete(slot, w.id);
    this.#workers.delete(name);
    this.#byId[w.id] = undefined;
    this.#freeIds.push(w.id);
  }

  /**
   * Records that a prompt's blocks (its keys from the first block on, as
   * promptKeys gives) were just sent to `name`: they count for it until
   * `speculativeTtlMs`.
   */
  speculate(name: string, keys: readonly number[], now = performance.now()): void {
    const w = this.#worker(name);
    if (!w) return;
    // An int32 in the inverted records (holders.ts): 2^31 ticks is 6.8 years.
    const until = Math.max(0, Math.min(0x7fffffff, Math.ceil((now + this.o.speculativeTtlMs) / SPEC_TICK_MS)));
    // An entry sent again keeps its place in the trimming order (set() alone
    // updates in place): a delete per key would double the decision's map work,
    // and the TTL, not the order, is what retires entries.
    if (keys.length > 0 && this.#held(w, keys[0]) === undefined) {
      w.specFirst.set(slotOf(keys[0]), until);
      this.#specHolders.set(slotOf(keys[0]), w.id, until);
    }
    for (let j = 1; j < keys.length; j++) if (this.#held(w, keys[j]) === undefined) w.spec.set(slotOf(keys[j]), until);
    trimOrdered(w.spec, this.o.maxSpeculative);
    trimOrdered(w.specFirst, this.o.maxSpeculative, this.#specHolders, w.id);
  }

  /**
   * Per candidate worker, the length (blocks) of the longest run of the
   * prompt's leading blocks (its keys from the first block on) it holds and
   * its tier-weighted sum, speculative entries counting as GPU blocks until
   * they expire. The first block is looked up once in the inverted side;
   * only the candidates holding it walk on, each to its first miss:
   * O(candidates + first-block holders x matched blocks).
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
    const n = this.#candidates(candidates, blocks, weight);
    const ids = this.#candIds;
    const tick = now / SPEC_TICK_MS;
    const runs = keys.length > 0 ? this.#firstBlock(keys[0], tick, blocks, weight) : 0;
    for (let i = 0; i < runs; i++) {
      const c = this.#run[i];
      const w = this.#byId[ids[c]] as WorkerBlocks;
      let m = 1;
      let sum = weight[c];
      for (; m < keys.length; m++) {
        const k = keys[m];
        const slot = slotOf(k);
        const v = w.keys.get(slot);
        if (v >= 0 && v >>> 3 === highOf(k)) sum += CODE_WEIGHT[v & 3];
        else if (w.spec.size > 0) {
          const s = w.spec.get(slot);
          if (s < 0 || s <= tick) break;
          sum += 1;
        } else break;
      }
      // A worker with blocks of several keys reuses whole blocks only.
      if (w.per > 1 && m % w.per !== 0) {
        m -= m % w.per;
        sum = m === 0 ? 0 : this.#runWeight(w, keys, m, weight[c], tick);
      }
      blocks[c] = m;
      weight[c] = sum;
    }
    // A worker named twice among the candidates gets the first one's run; `at` goes back to zeros.
    const at = this.#at;
    for (let c = 0; c < n; c++) {
      if (ids[c] < 0) continue;
      const first = at[ids[c]] - 1;
      if (first !== c) {
        blocks[c] = blocks[first];
        weight[c] = weight[first];
      }
    }
    for (let c = 0; c < n; c++) if (ids[c] >= 0) at[ids[c]] = 0;
  }

  /** The tier-weighted sum of a worker's first `m` matched keys (the first one's weight given). */
  #runWeight(w: WorkerBlocks, keys: readonly number[], m: number, first: number, tick: number): number {
    let sum = first;
    for (let j = 1; j < m; j++) {
      const v = w.keys.get(slotOf(keys[j]));
      sum += v >= 0 && v >>> 3 === highOf(keys[j]) ? CODE_WEIGHT[v & 3] : w.spec.get(slotOf(keys[j])) > tick ? 1 : 0;
    }
    return sum;
  }

  /** Zeroes the decision's arrays and maps the candidates' worker ids to their index (`at`, `#candIds`). */
  #candidates(candidates: readonly string[], blocks: Float64Array, weight: Float64Array): number {
    const n = candidates.length;
    if (this.#candIds.length < n) {
      this.#candIds = new Int32Array(Math.max(n, this.#candIds.length * 2));
      this.#run = new Int32Array(this.#candIds.length);
    }
    const at = this.#at;
    for (let c = 0; c < n; c++) {
      blocks[c] = 0;
      weight[c] = 0;
      const w = this.#workers.get(candidates[c]);
      this.#candIds[c] = w ? w.id : -1;
      if (w && at[w.id] === 0) at[w.id] = c + 1;
    }
    return n;
  }

  /**
   * The candidates holding the prompt's first block (key `k`), from the
   * inverted side: their blocks and weight for it set, their indexes in
   * `#run`; returns how many.
   */
  #firstBlock(k: number, tick: number, blocks: Float64Array, weight: Float64Array): number {
    const slot = slotOf(k);
    const high = highOf(k);
    const at = this.#at;
    const held = this.#holders;
    let runs = 0;
    for (let r = held.map.get(slot) ?? -1; r >= 0; r = held.next[r]) {
      const c = at[held.id[r]] - 1;
      const v = held.payload[r];
      if (c < 0 || blocks[c] !== 0 || v >>> 3 !== high) continue;
      blocks[c] = 1;
      weight[c] = CODE_WEIGHT[v & 3];
      this.#run[runs++] = c;
    }
    const spec = this.#specHolders;
    if (spec.size > 0)
      for (let r = spec.map.get(slot) ?? -1; r >= 0; r = spec.next[r]) {
        const c = at[spec.id[r]] - 1;
        if (c < 0 || blocks[c] !== 0 || spec.payload[r] <= tick) continue;
        blocks[c] = 1;
        weight[c] = 1;
        this.#run[runs++] = c;
      }
    return runs;
  }

  /** Both sides of the index, for consistency checks: per worker its map, and the inverted maps' entries. */
  views(): { workers: Map<string, WorkerView>; holders: Tuple3[]; specHolders: Tuple3[] } {
    const workers = new Map<string, WorkerView>();
    for (const [name, w] of this.#workers) {
      const [keys, spec, specFirst] = [w.keys, w.spec, w.specFirst].map((m) => [...m.entries()]);
      workers.set(name, { id: w.id, keys, spec, specFirst });
    }
    return { workers, holders: [...this.#holders.entries()], specHolders: [...this.#specHolders.entries()] };
  }

  /** Blocks a worker holds or was just sent (speculative entries, until trimmed): where new prefixes go least. */
  held(name: string): number {
    const w = this.#workers.get(name);
    return w ? w.keys.size + w.spec.size + w.specFirst.size : 0;
  }

  /** Whether any event of the worker's left blocks in the index (speculative entries aside). */
  knows(name: string): boolean {
    return (this.#workers.get(name)?.keys.size ?? 0) > 0;
  }
}
