// Every hold a worker has, in one table: a prefill's blocks waiting for their
// decode (read by a pull, or offered to a push), and a decode's answered turn
// waiting for the next turn's prefill. The KV mode's keeper (PrefillTracker or
// KvPushSender) decides when a hold ends; this table is where it ends: the
// one release path (releaseHold, releaseRequest, released early), the one
// place that counts why (stats.ts countRelease) and gives the blocks back.
import { type SpanLike, startSpan } from '../../tracing';
import type { BlockStore } from './block-store';
import { ReleasedEarly } from './released-early';
import { type ReleaseReason, type WorkerStats, countRelease } from './stats';

/** A prefill's hold, or a decode's held turn. */
export type HoldKind = 'prefill' | 'turn';

/** What ends a hold before its time: the KV mode's tracker or sender. */
export interface HoldKeeper {
  /** Frees the hold now because no one will read it; false when the keeper has none. */
  abort(id: string): boolean;
  /** The hold was read where it is (a decode in place). */
  consumed(id: string): void;
}

export interface HoldOptions {
  id: string;
  ids: number[];
  kind: HoldKind;
  keeper: HoldKeeper;
  /** The proxy's request id it is held for (releaseRequest frees it). */
  requestId?: string;
  /** Freed when this aborts (a held turn whose client left before the params reached it). */
  signal?: AbortSignal;
  /** A prefill's: the hold gets a span of its own, a child of this one, ended when its blocks go back. */
  span?: SpanLike;
}

/** A hold being made: its keeper says, through settles(), when and why it ends. */
export interface Hold {
  readonly id: string;
  readonly ids: number[];
  settles(released: Promise<{ reason: ReleaseReason }>): void;
}

/** A prefill running for a request: a release that comes meanwhile marks it. */
export interface Running {
  released: boolean;
}

interface Entry extends HoldOptions {
  /** Undoes what add() set up beside the table. */
  done(): void;
}

export class HoldTable {
  readonly #holds = new Map<string, Entry>();
  /** By the proxy's request id: the holds made for it. */
  readonly #of = new Map<string, Set<string>>();
  /** By the proxy's request id: its prefills still running. */
  readonly #running = new Map<string, Set<Running>>();
  /** Request ids released before any hold (or prefill) of theirs was made here. */
  readonly #early = new ReleasedEarly();
  #turnBlocks = 0;

  constructor(
    private readonly d: {
      stats: WorkerStats;
      blocks: BlockStore;
      /** Test hook: a prefill's blocks freed unread are overwritten at once. */
      poisonFreed?: boolean;
    },
  ) {}

  /** Holds of a kind (or all) right now. */
  count(kind?: HoldKind): number {
    if (kind === undefined) return this.#holds.size;
    let n = 0;
    for (const h of this.#holds.values()) if (h.kind === kind) n++;
    return n;
  }

  /** Blocks held turns take together. */
  get turnBlocks(): number {
    return this.#turnBlocks;
  }

  /** The blocks of hold `id`, when one of that kind is held here. */
  blocksOf(id: string, kind: HoldKind): readonly number[] | undefined {
    const h = this.#holds.get(id);
    return h?.kind === kind ? h.ids : undefined;
  }

  /** Whether the proxy released `requestId` lately, before anything of it was made here. */
  releasedEarly(requestId: string): boolean {
    return this.#early.has(requestId);
  }

  /** Notes a prefill running for requestId (a release marks it); end() when it is done. */
  begin(requestId: string): Running {
    const me = { released: this.#early.has(requestId) };
    getOrAdd(this.#running, requestId).add(me);
    return me;
  }

  end(requestId: string, me: Running): void {
    const running = this.#running.get(requestId);
    running?.delete(me);
    if (running?.size === 0) this.#running.delete(requestId);
  }

  /** Files a hold; its keeper settles it (Hold.settles), then its blocks go back here. */
  add(o: HoldOptions): Hold {
    const undo: Array<() => void> = [];
    if (o.requestId !== undefined) {
      const set = getOrAdd(this.#of, o.requestId).add(o.id);
      undo.push(() => {
        set.delete(o.id);
        if (set.size === 0 && this.#of.get(o.requestId!) === set) this.#of.delete(o.requestId!);
      });
    }
    if (o.signal) {
      const cut = () => o.keeper.abort(o.id);
      o.signal.addEventListener('abort', cut, { once: true });
      undo.push(() => o.signal!.removeEventListener('abort', cut));
    }
    // A prefill's hold outlives its request's span: it ends when the blocks go back.
    const span =
      o.span &&
      startSpan('kv.hold', {
        parent: o.span.context,
        attributes: { 'nixl_node.remote_request_id': o.id, 'nixl_node.blocks': o.ids.length },
      });
    this.#holds.set(o.id, {
      ...o,
      done: () => {
        for (const f of undo) f();
      },
    });
    if (o.kind === 'turn') this.#turnBlocks += o.ids.length;
    return {
      id: o.id,
      ids: o.ids,
      settles: (released) =>
        void released.then(({ reason }) => {
          span?.setAttribute('nixl_node.release_reason', reason === 'expired' ? 'lease' : reason);
          span?.end();
          this.#settled(o.id, reason);
        }),
    };
  }

  /** Frees a hold now (the proxy says its decode will not read it); false when there is none. */
  releaseHold(id: string): boolean {
    return this.#holds.get(id)?.keeper.abort(id) ?? false;
  }

  /** A hold read in place (a decode on this worker): freed as read. */
  consumed(id: string): void {
    this.#holds.get(id)?.keeper.consumed(id);
  }

  /**
   * Frees the holds a request (the proxy's id) made here, its held turn
   * included, and makes its prefills still running give theirs up; notes a
   * release that found nothing, for what of it comes later. How many it found.
   */
  releaseRequest(requestId: string): number {
    let n = 0;
    for (const p of this.#running.get(requestId) ?? []) {
      p.released = true;
      n++;
    }
    for (const id of [...(this.#of.get(requestId) ?? [])]) if (this.releaseHold(id)) n++;
    if (n === 0) this.#early.add(requestId);
    return n;
  }

  #settled(id: string, reason: ReleaseReason): void {
    const h = this.#holds.get(id);
    if (!h) return;
    this.#holds.delete(id);
    h.done();
    countRelease(this.d.stats, reason);
    if (h.kind === 'turn') this.#turnBlocks -= h.ids.length;
    else if (reason !== 'read' && this.d.poisonFreed) this.d.blocks.poison(h.ids);
    this.d.blocks.give(h.ids);
  }
}

/** The set under key, made when missing. */
function getOrAdd<T, V>(m: Map<T, Set<V>>, key: T): Set<V> {
  let v = m.get(key);
  if (!v) {
    v = new Set();
    m.set(key, v);
  }
  return v;
}
