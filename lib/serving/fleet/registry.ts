// A worker's membership in a fleet: its record under <prefix>workers/<name>,
// put under an etcd lease that the client keeps alive. A worker that dies
// disappears when the lease runs out (ttl); one that shuts down revokes it
// first, so proxies stop sending at once, then finishes what it holds. The
// record is put again when the load or free blocks it reports change. When
// etcd is unreachable the worker keeps serving and keeps trying (every 0.5 s,
// backing off to 5 s, a warning each time); a lost lease is granted anew.
// `registered` says whether the record is in etcd as far as the worker knows.
import type * as Etcd3 from 'etcd3';
import { type EtcdOptions, fleetPrefix } from './etcd';
import { etcdClient } from './etcd-client';
import { type FleetRole, type RecordKvEvents, type WorkerRecord, encodeRecord, servedNamesField } from './record';
import { type Logger, silentLogger } from '../log';
import { lineLogger } from './line-logger';

/** A worker's fleet options (startWorker's `etcd`). */
export interface FleetJoinOptions extends EtcdOptions {
  /** The pools it joins (default both: prefill and decode). */
  role?: FleetRole;
  /** Lease seconds: how long a dead worker stays listed (default 5). */
  ttlSec?: number;
  /** How often its load and free blocks are put again when they changed, ms (default 500). */
  reportMs?: number;
  /** On shutdown, the longest wait for requests in progress to finish after leaving, ms (default 10 s). */
  drainMs?: number;
  /** Where it says what happens, as text lines (default: the worker's logger, fields and a message). */
  log?: (line: string) => void;
}

/** What a registration reads from its worker. */
export interface FleetMember {
  readonly name: string;
  readonly address: string;
  readonly transport: 'http' | 'zmq';
  readonly modelId: string;
  /** Every name it serves (modelId first), when it has aliases. */
  readonly servedModelNames?: readonly string[];
  readonly freeBlocks: number;
  readonly totalBlocks: number;
  /** Requests in progress. */
  readonly load: number;
  /** Where it publishes KV events, when it does. */
  readonly kvEvents?: RecordKvEvents;
}

/** The longest wait between two registration attempts while etcd does not answer, ms. */
const MAX_RETRY_MS = 5000;

/** A worker's record in etcd, kept alive until close(). */
export class FleetRegistration {
  readonly key: string;
  readonly role: FleetRole;
  /** Puts that reached etcd; leases granted (more than 1: one was lost and granted anew). */
  readonly stats = { puts: 0, leases: 0, failures: 0 };
  readonly #client: Etcd3.Etcd3;
  readonly #member: FleetMember;
  readonly #o: FleetJoinOptions;
  readonly #log: Logger;
  #lease?: Etcd3.Lease;
  #registered = false;
  /** Failed attempts in a row, and when the next may start (ms, Date.now). */
  #failed = 0;
  #retryAt = 0;
  #last = '';
  #timer?: NodeJS.Timeout;
  #closed = false;
  #keepaliveDown = false;
  #putting?: Promise<void>;

  /** `logger`: the worker's (o.log, when given, takes the lines instead). */
  constructor(member: FleetMember, o: FleetJoinOptions, logger: Logger = silentLogger) {
    this.#member = member;
    this.#o = o;
    this.role = o.role ?? 'both';
    this.key = `${fleetPrefix(o)}workers/${member.name}`;
    this.#log = o.log ? lineLogger(o.log, `nixl-node worker ${member.name}`) : logger;
    this.#client = etcdClient(o);
  }

  /** Whether its record is in etcd, as far as it knows: put, and its lease not lost since. */
  get registered(): boolean {
    return this.#registered && !this.#closed;
  }

  /** What the worker's /health adds: its key and whether it is registered. */
  health(): { etcd: string; etcd_registered: boolean } {
    return { etcd: this.key, etcd_registered: this.registered };
  }

  /** The record as it would be put now. */
  record(): WorkerRecord {
    const m = this.#member;
    return {
      v: 1,
      name: m.name,
      role: this.role,
      model: m.modelId,
      ...servedNamesField(m.servedModelNames),
      address: m.address,
      transport: m.transport,
      freeBlocks: m.freeBlocks,
      totalBlocks: m.totalBlocks,
      load: m.load,
      ...(m.kvEvents ? { kv_events: m.kvEvents } : {}),
    };
  }

  /** Puts the record (waits for the first put, up to the call timeout), then keeps it fresh. */
  async join(): Promise<this> {
    await this.#put(true);
    this.#timer = setInterval(() => void this.#put(false), this.#o.reportMs ?? 500);
    this.#timer.unref();
    return this;
  }

  #newLease(): Etcd3.Lease {
    const lease = this.#client.lease(this.#o.ttlSec ?? 5);
    this.stats.leases++;
    lease.on('lost', (e: Error) => {
      if (this.#closed || this.#lease !== lease) return;
      this.#lease = undefined; // the next put grants a new one
      // A lease whose grant failed is lost too: the failed put says so.
      if (!this.#registered) return;
      this.#registered = false;
      this.#log.warn(this.#fields({ error: cause(e) }), 'etcd lease lost: registering again');
      void this.#put(true);
    });
    // Once per outage: keepalives run every third of the lease while etcd is away.
    lease.on('keepaliveFailed', (e) => {
      if (this.#keepaliveDown || this.#closed) return;
      this.#keepaliveDown = true;
      this.#log.warn(this.#fields({ error: cause(e as unknown as Error) }), 'etcd keepalive failed');
    });
    lease.on('keepaliveSucceeded', () => {
      if (!this.#keepaliveDown) return;
      this.#keepaliveDown = false;
      this.#log.info(this.#fields(), 'etcd keepalive succeeded again');
    });
    return lease;
  }

  #fields(more: Record<string, unknown> = {}): Record<string, unknown> {
    return { worker: this.#member.name, etcd_key: this.key, ...more };
  }

  /** Puts the record when it changed (or `force`); one put at a time; after failures, not before #retryAt. */
  #put(force: boolean): Promise<void> {
    if (this.#putting || this.#closed) return this.#putting ?? Promise.resolve();
    const value = encodeRecord(this.record());
    if (!force && value === this.#last && this.#lease) return Promise.resolve();
    if (!force && Date.now() < this.#retryAt) return Promise.resolve();
    this.#putting = (async () => {
      try {
        this.#lease ??= this.#newLease();
        await this.#lease.put(this.key).value(value);
        this.#last = value;
        this.stats.puts++;
        if (!this.#registered)
          this.#log.info(this.#fields(this.#failed ? { failed_attempts: this.#failed } : {}), 'registered in etcd');
        this.#registered = true;
        this.#failed = 0;
        this.#retryAt = 0;
      } catch (e) {
        this.stats.failures++;
        this.#registered = false;
        this.#last = ''; // put again at the next attempt
        this.#failed++;
        const wait = Math.min(MAX_RETRY_MS, (this.#o.reportMs ?? 500) * 2 ** (this.#failed - 1));
        this.#retryAt = Date.now() + wait;
        if (!this.#closed)
          this.#log.warn(
            this.#fields({ attempt: this.#failed, retry_ms: wait, error: cause(e as Error) }),
            'etcd registration failed: serving unregistered, retrying',
          );
      } finally {
        this.#putting = undefined;
      }
    })();
    return this.#putting;
  }

  /** Stops keeping the record alive without deleting it, as a crash would: it goes when the lease ends. */
  abandon(): void {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#timer);
    this.#lease?.release();
    this.#client.close();
  }

  /**
   * Leaves the fleet: the record is deleted (lease revoked) so proxies stop
   * sending, then waits until `idle()` (at least a moment, so a proxy that
   * picked it just before sees the answer), up to drainMs.
   */
  async leave(idle: () => boolean = () => true): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#timer);
    await this.#putting;
    const lease = this.#lease;
    try {
      await Promise.race([lease?.revoke(), new Promise((r) => setTimeout(r, 2000).unref())]);
    } catch (e) {
      this.#log.warn(
        this.#fields({ error: cause(e as Error), ttl_s: this.#o.ttlSec ?? 5 }),
        'could not revoke its etcd lease: its record ends with the lease',
      );
    }
    lease?.release();
    this.#client.close();
    const until = Date.now() + (this.#o.drainMs ?? 10_000);
    await new Promise((r) => setTimeout(r, 100));
    while (!idle() && Date.now() < until) await new Promise((r) => setTimeout(r, 50));
  }
}

/** Registers a worker in etcd (startWorker does it when given `etcd`). */
export async function joinFleet(member: FleetMember, o: FleetJoinOptions, logger?: Logger): Promise<FleetRegistration> {
  return new FleetRegistration(member, o, logger).join();
}

/** An etcd client error in a line: gRPC's status text, at most 300 characters. */
function cause(e: Error | undefined): string {
  return String(e?.message ?? e).slice(0, 300);
}
