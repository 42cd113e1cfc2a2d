// The local side of prepared transfers: our KV regions as block slices, and
// one prepared descriptor list per distinct slicing (shared by every remote
// engine whose plan slices our blocks alike).
import type { DlistHandle, NixlAgent } from '../agent';
import { DescList } from '../descriptors';
import { type BlockSlices, allBlockDescs } from './descs';
import type { KvLayout } from './layout';
import type { RankRead } from './tp';

/** @internal */
export class LocalDlists {
  readonly #agent: NixlAgent;
  readonly #layout: KvLayout;
  readonly #dlists = new Map<string, DlistHandle>();

  constructor(agent: NixlAgent, layout: KvLayout) {
    this.#agent = agent;
    this.#layout = layout;
  }

  /** The local block slices one planned read touches. */
  slices(read: RankRead): BlockSlices {
    const l = this.#layout;
    const end = read.regionStart + read.local.length;
    return {
      baseAddrs: l.baseAddrs.slice(read.regionStart, end),
      strides: (l.blockStrides ?? l.blockLens).slice(read.regionStart, end),
      offsets: read.local.map((s) => s.offset),
      lens: read.local.map((s) => s.len),
      devId: l.deviceId ?? 0,
    };
  }

  /** The prepared local list of a planned read (made once per slicing). */
  get(read: RankRead): DlistHandle {
    const key = `${read.regionStart}/${read.local.map((s) => `${s.offset}+${s.len}`).join(',')}`;
    let d = this.#dlists.get(key);
    if (!d) {
      d = this.#agent.prepXferDlist(
        '',
        new DescList(allBlockDescs(this.slices(read), this.#layout.numBlocks), this.#layout.memType ?? 'DRAM'),
      );
      this.#dlists.set(key, d);
    }
    return d;
  }

  get size(): number {
    return this.#dlists.size;
  }

  /** Releases every list. */
  close(): void {
    for (const d of this.#dlists.values()) {
      try {
        this.#agent.releaseDlistHandle(d);
      } catch {
        /* agent closed */
      }
    }
    this.#dlists.clear();
  }
}
