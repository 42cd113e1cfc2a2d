// What a worker's prefix cache holds, as KV events: the union of its
// holders' cached prefixes (a GGUF context's whole batches, a synthetic
// cache entry's blocks), block by block, reference-counted because two
// holders may share a prefix. A block is announced (BlockStored, with its
// tokens and its parent's hash) when the first holder takes it, and removed
// (BlockRemoved) when the last one lets it go: exactly what a prefill here
// can reuse, and never a removal of a block not announced.
import type { PrefixCacheListener } from '../../models/types';
import { blockDigests, noneHash, wireHash } from './block-hash';
import type { KvEvent } from './encode';

interface Held {
  digest: Buffer;
  refs: number;
}

export class BlockAnnouncer implements PrefixCacheListener {
  readonly #root: Buffer;
  /** Held blocks by hex digest. */
  readonly #blocks = new Map<string, Held>();
  /** Each holder's blocks (hex digests, in prefix order). */
  readonly #owners = new Map<unknown, string[]>();

  constructor(
    readonly blockSize: number,
    seed: string,
    private readonly emit: (e: KvEvent) => void,
  ) {
    this.#root = noneHash(seed);
  }

  /** Distinct blocks held. */
  get size(): number {
    return this.#blocks.size;
  }

  /** The hashes announced and not removed, as events carry them. */
  hashes(): bigint[] {
    return [...this.#blocks.values()].map((h) => wireHash(h.digest));
  }

  /** Tokens of `tokens` held here from its start (whole blocks). */
  cachedTokens(tokens: readonly number[]): number {
    let n = 0;
    for (const d of blockDigests(tokens, this.blockSize, this.#root)) {
      if (!this.#blocks.has(d.toString('hex'))) break;
      n += this.blockSize;
    }
    return n;
  }

  hold(owner: unknown, tokens: readonly number[]): void {
    const digests = blockDigests(tokens, this.blockSize, this.#root);
    const keys = digests.map((d) => d.toString('hex'));
    // Take the new ones before letting the old ones go: blocks both share are never removed and stored again.
    let run: number | undefined;
    const flush = (end: number) => {
      if (run === undefined) return;
      this.emit({
        type: 'BlockStored',
        blockHashes: digests.slice(run, end).map(wireHash),
        parentBlockHash: run > 0 ? wireHash(digests[run - 1]) : null,
        tokenIds: tokens.slice(run * this.blockSize, end * this.blockSize),
        blockSize: this.blockSize,
      });
      run = undefined;
    };
    keys.forEach((k, i) => {
      const h = this.#blocks.get(k);
      if (h) {
        h.refs++;
        flush(i);
      } else {
        this.#blocks.set(k, { digest: digests[i], refs: 1 });
        run ??= i;
      }
    });
    flush(keys.length);
    this.drop(owner);
    if (keys.length > 0) this.#owners.set(owner, keys);
  }

  drop(owner: unknown): void {
    const keys = this.#owners.get(owner);
    if (!keys) return;
    this.#owners.delete(owner);
    const gone: bigint[] = [];
    // Children first: a consumer never holds a block whose parent it was told is gone.
    for (const k of [...keys].reverse()) {
      const h = this.#blocks.get(k);
      if (!h || --h.refs > 0) continue;
      this.#blocks.delete(k);
      gone.push(wireHash(h.digest));
    }
    if (gone.length > 0) this.emit({ type: 'BlockRemoved', blockHashes: gone });
  }

  /** Forgets every holder and says so (AllBlocksCleared). */
  clear(): void {
    this.#owners.clear();
    this.#blocks.clear();
    this.emit({ type: 'AllBlocksCleared' });
  }
}
