// The proxy's view of a fleet: every record under <prefix>workers/, read
// once, then followed through a watch. Each record becomes a worker of the
// pools its role names; a deleted key (lease ended or revoked) takes it out.
// With etcd unreachable the last known set keeps serving (health checks and
// request failures still take dead workers out); the proxy says so in its
// log and in a metric, and reads everything again once etcd answers.
import type * as Etcd3 from 'etcd3';
import type { Stage, WorkerPool } from '../proxy/pool';
import { type EtcdOptions, fleetPrefix } from './etcd';
import { etcdClient } from './etcd-client';
import { type WorkerRecord, parseRecord } from './record';
import { type Logger, silentLogger } from '../log';
import { lineLogger } from './line-logger';

/** The proxy's fleet options (ProxyOptions.etcd). */
export interface FleetWatchOptions extends EtcdOptions {
  /** A full read this often even while the watch is fine, ms (default 10 s): a safety net, and how etcd being down is noticed without a watch event. */
  resyncMs?: number;
  /** Where it says what happens, as text lines (default: the proxy's logger, fields and a message). */
  log?: (line: string) => void;
}

type Gauge = import('prom-client').Gauge<string>;

/** Which pools a role joins. */
function stagesOf(r: WorkerRecord): Stage[] {
  if (r.role === 'both') return ['prefill', 'decode'];
  return [r.role];
}

/** The fleet as etcd lists it, applied to a proxy's pools. */
export class FleetDiscovery {
  /** Whether etcd answered last time we asked (or the watch is up). */
  connected = false;
  readonly stats = { resyncs: 0, ignored: 0, joined: 0, left: 0 };
  readonly #client: Etcd3.Etcd3;
  readonly #pools: Record<Stage, WorkerPool>;
  readonly #prefix: string;
  readonly #transport: 'http' | 'zmq';
  readonly #o: FleetWatchOptions;
  readonly #log: Logger;
  /** Key -> the record applied and the etcd revision it came from. */
  readonly #known = new Map<string, { record?: WorkerRecord; rev: bigint }>();
  /** Keys whose bad value was already reported (once per revision). */
  readonly #warned = new Map<string, bigint>();
  #watcher?: Etcd3.Watcher;
  #timer?: NodeJS.Timeout;
  #closed = false;
  #syncing?: Promise<void>;
  #gauge?: Gauge;

  constructor(
    pools: Record<Stage, WorkerPool>,
    transport: 'http' | 'zmq',
    o: FleetWatchOptions,
    registry?: import('prom-client').Registry,
    /** The proxy's (o.log, when given, takes the lines instead). */
    logger: Logger = silentLogger,
  ) {
    this.#pools = pools;
    this.#transport = transport;
    this.#o = o;
    this.#log = o.log ? lineLogger(o.log, 'nixl-node proxy') : logger;
    this.#prefix = `${fleetPrefix(o)}workers/`;
    this.#client = etcdClient(o);
    if (registry) {
      const prom = require('prom-client') as typeof import('prom-client');
      this.#gauge = new prom.Gauge({
        name: 'nixl_node_proxy_etcd_connected',
        help: '1 while etcd answers the proxy; 0: it routes over the last known fleet',
        registers: [registry],
      });
      const pools = this.#pools;
      new prom.Gauge({
        name: 'nixl_node_proxy_fleet_workers',
        help: 'Workers known from etcd, by stage',
        labelNames: ['stage'],
        registers: [registry],
        collect() {
          for (const s of ['encode', 'prefill', 'decode'] as const)
            this.set({ stage: s }, pools[s].workers.filter((w) => w.fleet !== undefined).length);
        },
      });
    }
  }

  /** Reads the fleet (waits up to the call timeout for etcd), then follows it. */
  async start(): Promise<this> {
    await this.resync();
    this.#timer = setInterval(() => void this.resync(), this.#o.resyncMs ?? 10_000);
    this.#timer.unref();
    void this.#watch();
    return this;
  }

  async #watch(): Promise<void> {
    try {
      const w = await this.#client.watch().prefix(this.#prefix).create();
      if (this.#closed) return void w.cancel();
      this.#watcher = w;
      w.on('put', (kv) => this.#apply(kv.key.toString(), BigInt(kv.mod_revision), kv.value));
      w.on('delete', (kv) => this.#apply(kv.key.toString(), BigInt(kv.mod_revision), undefined));
      w.on('disconnected', (e: Error) => this.#setConnected(false, e.message));
      // Events missed while it was down: read everything again.
      w.on('connected', () => void this.resync());
      w.on('error', (e: Error) => this.#setConnected(false, e.message));
    } catch (e) {
      this.#setConnected(false, (e as Error).message);
      if (!this.#closed) setTimeout(() => void this.#watch(), 1000).unref();
    }
  }

  /** One full read of the fleet, applied (what is gone is taken out). */
  resync(): Promise<void> {
    this.#syncing ??= (async () => {
      try {
        const res = await this.#client.getAll().prefix(this.#prefix).exec();
        const rev = BigInt(res.header.revision);
        const seen = new Set<string>();
        for (const kv of res.kvs) {
          const key = kv.key.toString();
          seen.add(key);
          this.#apply(key, BigInt(kv.mod_revision), kv.value);
        }
        // Gone by then, unless a newer event already put it back.
        for (const [key, k] of this.#known) if (!seen.has(key) && k.rev <= rev) this.#apply(key, rev, undefined);
        for (const [key, k] of this.#known) if (!k.record && k.rev <= rev) this.#known.delete(key);
        this.stats.resyncs++;
        this.#setConnected(true);
      } catch (e) {
        this.#setConnected(false, (e as Error).message);
      } finally {
        this.#syncing = undefined;
      }
    })();
    return this.#syncing;
  }

  #setConnected(up: boolean, why = ''): void {
    this.#gauge?.set(up ? 1 : 0);
    if (up === this.connected) return;
    this.connected = up;
    const n = this.#known.size;
    if (up) this.#log.info({ fleet_workers: n }, `etcd reachable: following ${n} fleet worker(s)`);
    else
      this.#log.warn(
        { fleet_workers: n, error: why.slice(0, 300) },
        `etcd unreachable: serving the last known ${n} fleet worker(s)`,
      );
  }

  /** A put (value) or delete (no value) at revision `rev`; older news than what is known is dropped. */
  #apply(key: string, rev: bigint, value: Buffer | undefined): void {
    if (this.#closed) return;
    const known = this.#known.get(key);
    if (known && known.rev > rev) return;
    let record: WorkerRecord | undefined;
    if (value !== undefined) {
      const r = parseRecord(value);
      if (typeof r === 'string') this.#ignore(key, rev, r);
      else if (r.transport !== this.#transport)
        this.#ignore(key, rev, `a ${r.transport} worker; this proxy speaks ${this.#transport}`);
      else record = r;
    }
    const before = known?.record;
    // A deleted or unreadable key stays known (no record) until a full read
    // newer than it, so that older news of it cannot bring it back.
    this.#known.set(key, { record, rev });
    if (before && (!record || before.address !== record.address || before.role !== record.role)) this.#remove(before);
    if (record) this.#add(record);
  }

  #ignore(key: string, rev: bigint, why: string): void {
    this.stats.ignored++;
    if (this.#warned.get(key) === rev) return;
    if (this.#warned.size > 10_000) this.#warned.clear();
    this.#warned.set(key, rev);
    this.#log.warn({ etcd_key: key.slice(0, 200), reason: why }, 'ignoring etcd key');
  }

  #add(r: WorkerRecord): void {
    for (const s of stagesOf(r)) {
      const pool = this.#pools[s];
      let w = pool.workers.find((x) => x.address === r.address);
      if (!w) {
        w = pool.add(r.address);
        w.fleet = r.name;
        this.stats.joined++;
      }
      if (w.fleet !== undefined) {
        w.reported = { load: r.load, freeBlocks: r.freeBlocks, totalBlocks: r.totalBlocks };
        w.kvEvents = r.kv_events;
      }
      w.model ??= r.model;
      if (w.model === r.model && r.servedModelNames) w.models ??= r.servedModelNames;
    }
  }

  #remove(r: WorkerRecord): void {
    for (const s of stagesOf(r)) {
      // Another key may list the same worker: it stays while one does.
      const listed = [...this.#known.values()].some(
        (k) => k.record?.address === r.address && stagesOf(k.record).includes(s),
      );
      if (listed) continue;
      const pool = this.#pools[s];
      const w = pool.workers.find((x) => x.address === r.address);
      // Workers given on the command line stay: etcd only adds to them.
      if (w?.fleet !== undefined && pool.remove(w)) this.stats.left++;
    }
  }

  /** Stops following (the workers it added stay in the pools). */
  async close(): Promise<void> {
    this.#closed = true;
    clearInterval(this.#timer);
    await this.#syncing;
    // etcd gone: the cancel never comes back; stop waiting after a second.
    await Promise.race([this.#watcher?.cancel().catch(() => {}), new Promise((r) => setTimeout(r, 1000).unref())]);
    this.#client.close();
  }
}
