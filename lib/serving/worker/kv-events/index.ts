// A worker's KV events (vLLM --kv-events-config): its model's prefix cache
// (PrefixCacheListener) -> events -> one batch per turn of the event loop
// (vLLM: one per scheduler step) -> the ZeroMQ publisher. Starts with
// AllBlocksCleared: whatever an earlier run of this worker announced is gone.
import type { ServingModel } from '../../models/types';
import { BlockAnnouncer } from './announcer';
import { type KvEventsConfig, type KvEventsSettings, parseKvEventsConfig } from './config';
import { type KvEvent, encodeBatch } from './encode';
import { KvEventPublisher, type KvEventsInfo } from './publisher';

export { type KvEventsConfig, parseKvEventsConfig, bindsEndpoint } from './config';
export type { KvEventsInfo } from './publisher';

export class KvEvents {
  #pending: KvEvent[] = [];
  #scheduled = false;
  #announcer?: BlockAnnouncer;

  private constructor(
    readonly settings: KvEventsSettings,
    readonly publisher: KvEventPublisher,
    readonly model: ServingModel,
  ) {}

  /**
   * Publishes `model`'s cache changes as `config` says, or returns undefined
   * when it says not to (vLLM's null publisher). `host`: where peers reach
   * this worker; `capacityBlocks`: the cache a model without its own keeps.
   */
  static async start(
    config: KvEventsConfig | string | undefined,
    model: ServingModel,
    host: string,
    capacityBlocks: number,
  ): Promise<KvEvents | undefined> {
    const settings = parseKvEventsConfig(config);
    if (!settings.enabled || settings.publisher === 'null') return undefined;
    const k = new KvEvents(settings, await KvEventPublisher.open(settings, host), model);
    k.#emit({ type: 'AllBlocksCleared' });
    model.watchPrefixCache?.((blockSize) => {
      k.#announcer = new BlockAnnouncer(blockSize, settings.hashSeed, (e) => k.#emit(e));
      return k.#announcer;
    }, capacityBlocks);
    return k;
  }

  /** Where consumers connect, and the announced block size (a worker's /health and etcd record). */
  get info(): KvEventsInfo & { block_size?: number } {
    const b = this.#announcer?.blockSize;
    return { ...this.publisher.info, ...(b ? { block_size: b } : {}) };
  }

  /** The hashes announced and not removed (what a consumer's index of this worker should hold). */
  announced(): bigint[] {
    return this.#announcer?.hashes() ?? [];
  }

  /** Its part of /health. */
  health(): { kv_events: KvEventsInfo & { block_size?: number } } {
    return { kv_events: this.info };
  }

  /** Resets the model's prefix cache (vLLM's reset_prefix_cache) and says so: AllBlocksCleared. */
  reset(): void {
    this.model.resetPrefixCache?.();
    if (this.#announcer) this.#announcer.clear();
    else this.#emit({ type: 'AllBlocksCleared' });
  }

  #emit(e: KvEvent): void {
    this.#pending.push(e);
    if (this.#scheduled) return;
    this.#scheduled = true;
    setImmediate(() => this.#flush());
  }

  #flush(): void {
    this.#scheduled = false;
    const events = this.#pending;
    this.#pending = [];
    if (events.length === 0) return;
    this.publisher.publish(encodeBatch(events, { ts: Date.now() / 1000, encoding: this.settings.encoding }));
  }

  async close(): Promise<void> {
    this.#flush();
    await this.publisher.close();
  }
}
