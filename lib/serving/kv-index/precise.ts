// The 'precise' policy: the proxy subscribes to each prefill worker's KV
// events, indexes which worker holds which prefix block (index.ts), and
// sends a request to the prefill that holds the longest run of its prompt's
// leading blocks (tier-weighted), weighed against load as llm-d weighs them
// (prefix 2, KV utilisation 1, queue 1). Each decision adds a short-lived
// speculative entry for the chosen worker until its event arrives.
import type { Registry } from 'prom-client';
import { type RoutingOptions, affinityKey, loadOf, pickByLoad } from '../fleet/routing';
import type { Policy, WorkerPool } from '../proxy/pool';
import type { Logger } from '../log';
import type { WorkerRef } from '../proxy/worker-ref';
import { BatchRefused, type DecodeLimits, type KvEvent, decodeBatch } from './decode';
import { KeySize } from './block-size';
import { AdvertisedFollower } from './discover';
import { type IndexOptions, KvBlockIndex, promptKeys } from './index';
import { type KvIndexMetrics, kvIndexMetrics } from './metrics';
import { DecisionScratch } from './scratch';
import { type EventEndpoint, EventSubscriber } from './subscriber';
import { ggufTokenizer } from './gguf-tokenizer';
import { type PromptTokenizer, syntheticTokenizer, workerTokenizer } from './tokenizer';

/** The proxy's KV events (`startProxy({ kvEvents })`): whom to follow, how to tokenize, bounds, weights. */
export interface KvEventsOptions {
  /** Worker (its address as given, or its fleet name) -> where it publishes (--kv-events-endpoint); wins over what it advertises. */
  endpoints?: Record<string, EventEndpoint>;
  /**
   * Tokens per key of the index (--kv-block-size): workers whose block size is a multiple are followed.
   * Default: the greatest common divisor of the block sizes advertised or stored (down to 16), else 16.
   */
  blockSize?: number;
  /**
   * How the proxy gets a prompt's token ids: 'local' (the synthetic model's; default), 'worker' (a prefill's
   * /tokenize), `{ gguf: path }` (the workers' GGUF, its vocabulary loaded in the proxy), or your own.
   */
  tokenizer?: PromptTokenizer | 'local' | 'worker' | { gguf: string };
  index?: IndexOptions;
  limits?: DecodeLimits;
  /** Weights of the scores (llm-d's sample profile: prefix 2, kv utilisation 1, queue 1). */
  weights?: { prefix?: number; kvUtilization?: number; queue?: number };
  /** How often the advertised publishers are checked against the subscriptions, ms (default 1000; also before a decision). */
  followMs?: number;
}

/** The stats key of each decision reason, made once: a key built per decision is a string to hash each time. */
const DECISION_KEY = { no_tokens: 'decisions:no_tokens', prefix: 'decisions:prefix', load: 'decisions:load' };

/** A decision looks at the advertisements again at most this often (ms); the timer does the rest. */
const SYNC_ON_PICK_MS = 250;

/** One request's routing: its prompt's block keys, and what the decision was (for the answer). */
export interface PreciseHint {
  keys: number[];
  /** The 'load' policy's prefix affinity: where a prompt no prefill holds goes (as without events). */
  affinity?: string;
  /** Set by the decision. */
  prefill?: string;
  prefixMatchTokens?: number;
}

/** Parses `WORKER=PUB[,REPLAY][,topic=TOPIC]` (--kv-events-endpoint). */
export function parseEventEndpoint(spec: string): [string, EventEndpoint] {
  // The worker's name may hold '=' (a URL's query); its publisher starts at '=tcp://' or '=ipc://'.
  const at = spec.search(/=(tcp|ipc):\/\//);
  const eq = at >= 0 ? at : spec.indexOf('=');
  const worker = spec.slice(0, eq);
  const parts = spec.slice(eq + 1).split(',');
  const topicAt = parts.findIndex((p) => p.startsWith('topic='));
  const topic = topicAt >= 0 ? parts.splice(topicAt, 1)[0].slice('topic='.length) : undefined;
  const [pub, replay, extra] = parts;
  if (
    eq <= 0 ||
    !pub ||
    extra !== undefined ||
    (topicAt >= 0 && topicAt !== parts.length) ||
    !/^(tcp|ipc):\/\//.test(pub) ||
    (replay && !/^(tcp|ipc):\/\//.test(replay))
  )
    throw Object.assign(
      new Error(`--kv-events-endpoint wants WORKER=tcp://PUB[,tcp://REPLAY][,topic=TOPIC], not '${spec}'`),
      { code: 'NIXL_ERR_INVALID_PARAM' },
    );
  return [worker, { pub, ...(replay ? { replay } : {}), ...(topic ? { topic } : {}) }];
}

export class PreciseRouting {
  readonly index: KvBlockIndex;
  readonly stats: Record<string, number> = {};
  readonly #subs = new Map<string, EventSubscriber>();
  readonly #metrics?: KvIndexMetrics;
  readonly #tokenizer: PromptTokenizer;
  /** The GGUF vocabulary this router loads (tokenizer { gguf }), which it closes. */
  readonly #vocab?: Promise<PromptTokenizer & { close(): Promise<void> }>;
  readonly #keySize: KeySize;
  /** Workers whose events' block size was refused (logged once per subscription). */
  readonly #refusedSizes = new Set<string>();
  #rekeying = false;
  readonly #w: { prefix: number; kvUtilization: number; queue: number };
  readonly #pool?: { workers: readonly WorkerRef[]; routing?: RoutingOptions };
  /** The names given --kv-events-endpoint (as the pool names them). */
  readonly #explicit: Set<string>;
  readonly follower: AdvertisedFollower;
  #timer?: NodeJS.Timeout;
  readonly #scratch = new DecisionScratch();
  /** nameOf, bound once (not a closure per decision). */
  readonly #nameOf = (w: WorkerRef) => this.nameOf(w);
  #synced = Number.NEGATIVE_INFINITY;

  constructor(
    readonly o: KvEventsOptions = {},
    registry?: Registry,
    readonly log?: Logger,
    /** The prefill workers ('worker' tokenizer: whom to ask). */
    pool?: { workers: readonly WorkerRef[]; routing?: RoutingOptions },
  ) {
    this.#keySize = new KeySize(o.blockSize);
    this.index = new KvBlockIndex(o.index, o.blockSize);
    this.#metrics = registry ? kvIndexMetrics(registry, () => this.index.size) : undefined;
    const t = o.tokenizer ?? 'local';
    if (typeof t === 'object' && 'gguf' in t) {
      const vocab = ggufTokenizer(t.gguf);
      vocab.catch(() => {}); // ready() reports it; a decision meanwhile routes by load
      this.#vocab = vocab;
    }
    const vocab = this.#vocab;
    this.#tokenizer =
      t === 'local'
        ? syntheticTokenizer
        : t === 'worker'
          ? workerTokenizer(() => (pool?.workers ?? []).filter((w) => w.healthy).map((w) => w.address))
          : vocab
            ? { tokens: (body) => vocab.then((v) => v.tokens(body)) }
            : (t as PromptTokenizer);
    this.#w = { prefix: 2, kvUtilization: 1, queue: 1, ...o.weights };
    this.#pool = pool;
    this.#explicit = new Set(Object.keys(o.endpoints ?? {}).map(poolName));
    this.follower = new AdvertisedFollower({
      subscribe: (name, ep) => this.subscribe(name, ep),
      unsubscribe: (name) => this.unsubscribe(name),
      refuses: (size) => this.#consider(size),
      refuse: (name, why) => {
        this.#count('refused', 1, 'block_size');
        this.log?.warn({ worker: name, code: 'NIXL_ERR_INVALID_PARAM' }, `${name}: ${why}`);
      },
      info: (name, msg) => this.log?.info({ worker: name }, `${name}: ${msg}`),
    });
  }

  get blockSize(): number {
    return this.#keySize.value ?? 16;
  }

  /**
   * Whether a worker with blocks of `size` tokens can be keyed: undefined
   * when it can (B adopted, or lowered and every worker followed again from
   * a replay, later: this may run inside a subscriber's callback), else why not.
   */
  #consider(size: number): string | undefined {
    const v = this.#keySize.consider(size);
    if (!v.follow) return v.why;
    if (v.adopt !== undefined) this.index.keySize = v.adopt;
    if (v.rekey !== undefined) {
      this.index.keySize = v.rekey;
      this.index.clear();
      this.log?.info(
        { blockSize: v.rekey },
        `KV index: keying prompts by ${v.rekey}-token blocks now (block_size ${size} seen); following every worker again`,
      );
      if (!this.#rekeying) {
        this.#rekeying = true;
        setImmediate(() => {
          this.#rekeying = false;
          for (const [name, sub] of [...this.#subs]) this.subscribe(name, sub.endpoint);
        });
      }
    }
    return undefined;
  }

  #count(what: string, n = 1, label?: string, key = label ? `${what}:${label}` : what): void {
    this.stats[key] = (this.stats[key] ?? 0) + n;
    this.#metrics?.count(what, n, label);
  }

  /** Subscribes to every configured publisher, then follows those the prefills advertise. */
  /** Resolves once the tokenizer is loaded (a GGUF vocabulary); rejects with its error (a bad file: NIXL_ERR_INVALID_PARAM). */
  async ready(): Promise<void> {
    await this.#vocab;
  }

  start(): void {
    for (const [name, ep] of Object.entries(this.o.endpoints ?? {})) this.subscribe(name, ep);
    this.sync();
    this.#timer = setInterval(() => this.sync(), this.o.followMs ?? 1000);
    this.#timer.unref();
  }

  /** Subscribes to the publishers the prefills advertise now, and drops those no longer advertised. */
  sync(): void {
    this.#synced = performance.now();
    if (this.#pool) this.follower.sync(this.#pool.workers, this.#explicit);
  }

  /** Follows one worker's events (again: the old subscription goes, and its index with it). */
  subscribe(worker: string, ep: EventEndpoint): void {
    // Named as the pool names it (an HTTP address without its trailing slashes).
    const name = poolName(worker);
    this.unsubscribe(name);
    const sub = new EventSubscriber(
      ep,
      {
        apply: (_seq, payload) => this.applyPayload(name, payload),
        clear: () => this.index.drop(name),
        count: (what) => this.#count(what),
      },
      () => this.#count('dropped', 1, 'malformed_message'),
    );
    this.#subs.set(name, sub);
    sub.start();
  }

  /** The worker left: its subscription and its index go. */
  unsubscribe(name: string): void {
    this.#subs.get(name)?.close();
    this.#subs.delete(name);
    this.#refusedSizes.delete(name);
    this.index.drop(name);
  }

  /** Decodes and applies one batch of a worker's events; malformed parts are dropped and counted. */
  applyPayload(name: string, payload: Uint8Array): void {
    let batch: ReturnType<typeof decodeBatch>;
    try {
      batch = decodeBatch(payload, this.o.limits);
    } catch (e) {
      if (!(e instanceof BatchRefused)) throw e;
      this.#count('dropped', 1, 'malformed_batch');
      return;
    }
    for (const [why, n] of Object.entries(batch.dropped)) this.#count('dropped', n, why);
    if (this.index.keySize === undefined && this.#sizes(name, batch.events)) return;
    const counts = this.index.apply(name, batch.events);
    // Stores the index could not key: B may go down for them (this batch comes again by replay), else refused.
    if (counts.block_size && this.#sizes(name, batch.events)) return;
    if (counts.applied) this.#count('applied', counts.applied);
    for (const why of ['unknown_parent', 'unknown_block', 'too_many_workers', 'block_size', 'too_large'])
      if (counts[why]) this.#count('dropped', counts[why], why);
  }

  /**
   * Considers the block sizes of a batch's stores the index cannot key (B
   * adopted or lowered, else a warning once per subscription); whether B
   * went down, every worker to be followed again.
   */
  #sizes(name: string, events: readonly KvEvent[]): boolean {
    for (const e of events) {
      if (e.type !== 'BlockStored' || e.tokenIds.length === 0 || e.blockSize === this.index.keySize) continue;
      const why = this.#consider(e.blockSize);
      if (this.#rekeying) return true;
      if (why !== undefined && !this.#refusedSizes.has(name)) {
        this.#refusedSizes.add(name);
        this.log?.warn({ worker: name, code: 'NIXL_ERR_INVALID_PARAM' }, `${name}: its events' ${why}`);
      }
    }
    return false;
  }

  /** The routing hint of a request: its prompt's block keys (undefined when its tokens are not known). */
  hint(body: Record<string, unknown>): PreciseHint | undefined | Promise<PreciseHint | undefined> {
    const lora = typeof body.lora_name === 'string' ? body.lora_name : null;
    const keyed = (tokens: number[] | undefined) =>
      tokens ? { keys: promptKeys(tokens, this.blockSize, lora) } : undefined;
    const tokens = this.#tokenizer.tokens(body);
    return tokens instanceof Promise ? tokens.then(keyed, () => undefined) : keyed(tokens);
  }

  /** A worker left the pool (etcd): its index and its subscription go. */
  left(w: WorkerRef): void {
    const name = this.nameOf(w);
    this.follower.forget(name);
    this.unsubscribe(name);
  }

  /** The name a worker's events go by: the key of its --kv-events-endpoint, else its fleet name or address. */
  nameOf(w: WorkerRef): string {
    if (this.#subs.has(w.address)) return w.address;
    if (w.fleet && this.#subs.has(w.fleet)) return w.fleet;
    return w.fleet ?? w.address;
  }

  /** The prefill for a request among `from` (healthy, accepted); ties in turn. */
  pick(from: readonly WorkerRef[], hint: unknown, turn: number): WorkerRef | undefined {
    if (from.length === 0) return undefined;
    if (performance.now() - this.#synced >= SYNC_ON_PICK_MS) this.sync();
    const h = hint as PreciseHint | undefined;
    const d = this.#scratch.fill(from, this.#nameOf);
    if (h) this.index.matchInto(h.keys, d.names, d.blocks, d.weight);
    let i = h && d.anyMatch() ? this.#best(from, d, h.keys.length, false, turn) : -1;
    if (i < 0) i = this.#place(from, d, h, turn);
    const blocks = d.blocks[i];
    const why = !h ? 'no_tokens' : blocks > 0 ? 'prefix' : 'load';
    this.#count('decisions', 1, why, DECISION_KEY[why]);
    if (h) {
      h.prefill = d.names[i];
      h.prefixMatchTokens = blocks * this.blockSize;
      this.index.speculate(d.names[i], h.keys);
    }
    return from[i];
  }

  /**
   * A prompt no prefill holds any of. Once an event has confirmed a decision
   * (the proxy's keys are the workers'), it goes by load and then to the
   * prefill holding the fewest blocks, so that new prefixes spread instead
   * of piling onto the prefill their rendezvous hash picks, whose contexts
   * would evict each other. Before that (no events, or prompts the proxy
   * tokenizes otherwise than the workers), the 'load' policy's prefix
   * affinity, as without events.
   */
  #place(from: readonly WorkerRef[], d: DecisionScratch, h: PreciseHint | undefined, turn: number): number {
    if (h && this.index.confirmed > 0 && d.names.some((n) => this.index.knows(n)))
      return this.#best(from, d, 0, true, turn);
    if (h?.affinity !== undefined) {
      const w = pickByLoad(from, turn, h.affinity, this.#pool?.routing);
      if (w) return from.indexOf(w);
    }
    return this.#best(from, d, 0, false, turn);
  }

  /**
   * The best-scoring candidate (ties in turn): prefix 2 (the matched run's
   * tier-weighted share of the prompt), KV utilisation 1 (what the worker
   * reports, else with `byHeld` the blocks the index holds for it against the
   * fullest candidate's), queue 1 (load against the candidates' range).
   */
  #best(from: readonly WorkerRef[], d: DecisionScratch, promptBlocks: number, byHeld: boolean, turn: number): number {
    const n = from.length;
    let maxQ = Number.NEGATIVE_INFINITY;
    let minQ = Number.POSITIVE_INFINITY;
    let maxHeld = 0;
    for (let i = 0; i < n; i++) {
      d.loads[i] = loadOf(from[i]);
      maxQ = Math.max(maxQ, d.loads[i]);
      minQ = Math.min(minQ, d.loads[i]);
      d.held[i] = byHeld ? this.index.held(d.names[i]) : 0;
      maxHeld = Math.max(maxHeld, d.held[i]);
    }
    let bestScore = Number.NEGATIVE_INFINITY;
    let ties = 0;
    for (let i = 0; i < n; i++) {
      const r = from[i].reported;
      const kv = r && r.totalBlocks > 0 ? r.freeBlocks / r.totalBlocks : maxHeld > 0 ? 1 - d.held[i] / maxHeld : 1;
      const queue = maxQ === minQ ? 1 : (maxQ - d.loads[i]) / (maxQ - minQ);
      const prefix = promptBlocks > 0 ? d.weight[i] / promptBlocks : 0;
      const s = this.#w.prefix * prefix + this.#w.kvUtilization * kv + this.#w.queue * queue;
      if (s > bestScore + 1e-9) {
        bestScore = s;
        ties = 0;
      } else if (s < bestScore - 1e-9) continue;
      d.tied[ties++] = i;
    }
    return d.tied[turn % ties];
  }

  /** What the answer says of the decision (nixl_node.prefill, nixl_node.prefix_match_tokens). */
  static annotation(hint: unknown): Record<string, unknown> | undefined {
    const h = hint as PreciseHint | undefined;
    if (!h || typeof h !== 'object' || h.prefill === undefined) return undefined;
    return { prefill: h.prefill, prefix_match_tokens: h.prefixMatchTokens ?? 0 };
  }

  async close(): Promise<void> {
    clearInterval(this.#timer);
    for (const s of this.#subs.values()) s.close();
    this.#subs.clear();
    await this.#vocab?.then(
      (v) => v.close(),
      () => {},
    );
  }
}

/** A worker's name as the pool has it (an HTTP address without its trailing slashes). */
function poolName(worker: string): string {
  return /^https?:/.test(worker) ? worker.replace(/\/+$/, '') : worker;
}

/** The proxy's precise routing for its prefill pool, when the policy or the options ask for it. */
export function preciseFor(
  policy: Policy,
  pool: WorkerPool,
  o: KvEventsOptions | undefined,
  registry?: Registry,
  log?: Logger,
): PreciseRouting | undefined {
  if (policy !== 'precise' && !o?.endpoints) return undefined;
  const r = new PreciseRouting(o, registry, log, pool);
  pool.router = r;
  return r;
}

/** What a request's prefill is picked by: its prefix affinity ('load') or its prompt's blocks ('precise'). */
export async function prefillKey(
  policy: Policy,
  body: Record<string, unknown>,
  routing: RoutingOptions | undefined,
  precise: PreciseRouting | undefined,
): Promise<string | PreciseHint | undefined> {
  if (policy === 'load') return affinityKey(body, routing);
  if (policy !== 'precise' || !precise) return undefined;
  const affinity = affinityKey(body, routing);
  const withAffinity = (h: PreciseHint | undefined) => (h && affinity !== undefined ? { ...h, affinity } : h);
  const h = precise.hint(body);
  return h instanceof Promise ? h.then(withAffinity) : withAffinity(h);
}
