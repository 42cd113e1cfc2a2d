// The synthetic model's prefix cache: the full blocks of the prompts it
// prefilled most recently, up to a number of blocks (LRU by prompt; shared
// prefixes count once). A prompt whose first blocks are cached reports them
// as reused, as vLLM's prefix cache would; the announcer says what it holds.
import { createHash } from 'node:crypto';
import type { PrefixCacheListener } from './types';

export class SyntheticPrefixCache {
  /** Prompts held, oldest first, by their tokens' key. */
  readonly #lru = new Map<string, true>();

  constructor(
    private readonly l: PrefixCacheListener,
    readonly blockSize: number,
    readonly capacityBlocks: number,
  ) {}

  /** Forgets every prompt (the announcer is cleared by its owner). */
  clear(): void {
    this.#lru.clear();
  }

  /** Records a prefilled prompt; returns the tokens of it that were cached before (whole blocks). */
  prefill(tokens: readonly number[]): number {
    const full = Math.min(Math.floor(tokens.length / this.blockSize), this.capacityBlocks);
    const hit = this.l.cachedTokens(tokens);
    if (full === 0) return hit;
    const kept = tokens.slice(0, full * this.blockSize);
    const key = createHash('sha256').update(Uint32Array.from(kept)).digest('base64');
    this.#lru.delete(key);
    this.#lru.set(key, true);
    this.l.hold(key, kept);
    for (const old of this.#lru.keys()) {
      if (this.l.size <= this.capacityBlocks || old === key) break;
      this.#lru.delete(old);
      this.l.drop(old);
    }
    return hit;
  }
}
