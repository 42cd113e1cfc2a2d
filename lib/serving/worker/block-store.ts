// A worker's KV cache as the roles and turns use it: the memory registered
// with its agent (one region per layer), the free list and queue of blocks
// (BlockPool), and a request's blocks as the model reads and writes them.
import type { NixlAgent } from '../../agent';
import { DescList, allocate } from '../../descriptors';
import { NixlError } from '../../errors';
import type { KvLayout } from '../../kv/layout';
import type { BlockView, KvGeometry } from '../models/types';
import { BlockPool, type BlockQueueOptions, tooLarge } from './blocks';

export class BlockStore {
  readonly pool: BlockPool;
  readonly #mem: Buffer;

  constructor(
    agent: NixlAgent,
    readonly geometry: KvGeometry,
    blocks: number,
    queue: BlockQueueOptions,
  ) {
    this.pool = new BlockPool(blocks, queue);
    this.#mem = allocate(geometry.layers * blocks * geometry.blockBytes);
    agent.registerMemory(this.#mem);
  }

  /** The layout its side channel and puller describe: layer l's region follows layer l-1's. */
  layout(engineId: string): KvLayout {
    const { layers, blockBytes, tokensPerBlock } = this.geometry;
    const regionBytes = this.size * blockBytes;
    const base = DescList.from(this.#mem).addr(0);
    return {
      engineId,
      tpSize: 1,
      tpRank: 0,
      numBlocks: this.size,
      blockSize: tokensPerBlock,
      blockLens: Array(layers).fill(blockBytes),
      baseAddrs: Array.from({ length: layers }, (_, l) => base + BigInt(l * regionBytes)),
      kvCacheLayout: 'LBHNC',
      totalNumKvHeads: 8,
    };
  }

  get size(): number {
    return this.pool.size;
  }

  /** Blocks free right now. */
  get available(): number {
    return this.pool.available;
  }

  /** Requests waiting for blocks. */
  get waiting(): number {
    return this.pool.waiting;
  }

  /** n blocks now, or undefined (fewer free, or requests wait): what a held turn takes, never waiting. */
  take(n: number): number[] | undefined {
    return n <= this.pool.available ? (this.pool.take(n) ?? undefined) : undefined;
  }

  /** n blocks once free, in order (blocks.ts: 400 too large, 503 busy, 499 gone). */
  acquire(n: number, signal: AbortSignal): Promise<number[]> {
    return this.pool.acquire(n, signal);
  }

  /** acquire(), as blocks given back once. */
  async acquireTaken(n: number, signal: AbortSignal): Promise<Taken> {
    return new Taken(this, await this.pool.acquire(n, signal));
  }

  give(ids: readonly number[]): void {
    this.pool.give(ids);
  }

  /** A 400 (kv_request_too_large) when a request's KV cannot fit this cache even when empty. */
  fits(n: number): void {
    if (n > this.size) throw tooLarge(n, this.size);
  }

  /** Block `ids[b]` of layer l: a request's logical block b. */
  view(ids: readonly number[]): BlockView {
    const { blockBytes } = this.geometry;
    return (b, l) => {
      if (b < 0 || b >= ids.length)
        throw new NixlError(`block ${b} of a request of ${ids.length}`, 'NIXL_ERR_INVALID_PARAM');
      const at = (l * this.size + ids[b]) * blockBytes;
      return this.#mem.subarray(at, at + blockBytes);
    };
  }

  /** Overwrites blocks (the poisonFreed test hook: as a reused block would be). */
  poison(ids: readonly number[]): void {
    const view = this.view(ids);
    for (let b = 0; b < ids.length; b++) for (let l = 0; l < this.geometry.layers; l++) view(b, l).fill(0xa5);
  }

  close(): void {
    this.pool.close();
  }
}

/** A request's blocks: give() puts them back once, however many paths call it. */
export class Taken {
  #given = false;

  constructor(
    private readonly store: BlockStore,
    readonly ids: number[],
  ) {}

  get length(): number {
    return this.ids.length;
  }

  readonly give = (): void => {
    if (this.#given) return;
    this.#given = true;
    this.store.give(this.ids);
  };

  /** Hands the giving back over (to a quarantine that gives later): give() here does nothing from now on. */
  handOver(): () => void {
    const mine = !this.#given;
    this.#given = true;
    return () => {
      if (mine) this.store.give(this.ids);
    };
  }
}
