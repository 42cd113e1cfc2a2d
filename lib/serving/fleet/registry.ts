// A worker's membership in a fleet: its record under <prefix>workers/<name>,
// put under an etcd lease that the client keeps alive. A worker that dies
// disappears when the lease runs out (ttl); one that shuts down revokes it
// first, so proxies stop sending at once, then finishes what it holds. The
// record is put again when the load or free blocks it reports change. When
// etcd is unreachable the worker keeps serving and keeps trying; a lost
// lease is granted anew.
import type * as Etcd3 from 'etcd3';
import { type EtcdOptions, fleetPrefix } from './etcd';
import { etcdClient } from './etcd-client';
import { type FleetRole, type WorkerRecord, encodeRecord } from './record';

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
  /** Where it says what happens (default: a line on stderr). */
  log?: (line: string) => void;
}

/** What a registration reads from its worker. */
export interface FleetMember {
  readonly name: string;
  readonly address: string;
  readonly transport: 'http' | 'zmq';
  readonly modelId: string;
  readonly freeBlocks: number;
  readonly totalBlocks: number;
  /** Requests in progress. */
  readonly load: number;
}

const stderr = (line: string) => process.stderr.write(`${line}\n`);

/** A worker's record in etcd, kept alive until close(). */
export class FleetRegistration {
  readonly key: string;
  readonly role: FleetRole;
  /** Puts that reached etcd; leases granted (more than 1: one was lost and granted anew). */
  readonly stats = { puts: 0, leases: 0, failures: 0 };
  readonly #client: Etcd3.Etcd3;
  readonly #member: FleetMember;
  readonly #o: FleetJoinOptions;
  readonly #log: (line: string) => void;
  #lease?: Etcd3.Lease;
  #last = '';
  #timer?: NodeJS.Timeout;
  #closed = false;
  #down = false;
  #putting?: Promise<void>;

  constructor(member: FleetMember, o: FleetJoinOptions) {
    this.#member = member;
    this.#o = o;
    this.role = o.role ?? 'both';
    this.#log = o.log ?? stderr;
    this.key = `${fleetPrefix(o)}workers/${member.name}`;
    this.#client = etcdClient(o);
  }

  /** The record as it would be put now. */
  record(): WorkerRecord {
    const m = this.#member;
    return {
      v: 1,
      name: m.name,
      role: this.role,
      model: m.modelId,
      address: m.address,
      transport: m.transport,
      freeBlocks: m.freeBlocks,
      totalBlocks: m.totalBlocks,
      load: m.load,
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
      this.#say(true, `lease lost (${e.message}): registering again`);
      void this.#put(true);
    });
    lease.on('keepaliveFailed', (e) => this.#say(true, `keepalive failed: ${(e as unknown as Error).message}`));
    lease.on('keepaliveSucceeded', () => this.#say(false, 'etcd reachable again'));
    return lease;
  }

  /** Puts the record when it changed (or `force`); one put at a time. */
  #put(force: boolean): Promise<void> {
    if (this.#putting || this.#closed) return this.#putting ?? Promise.resolve();
    const value = encodeRecord(this.record());
    if (!force && value === this.#last && this.#lease) return Promise.resolve();
    this.#putting = (async () => {
      try {
        this.#lease ??= this.#newLease();
        await this.#lease.put(this.key).value(value);
        this.#last = value;
        this.stats.puts++;
        this.#say(false, 'registered again');
      } catch (e) {
        this.stats.failures++;
        this.#last = ''; // put again at the next tick
        this.#say(true, `cannot register ${this.key}: ${(e as Error).message}; serving on, retrying`);
      } finally {
        this.#putting = undefined;
      }
    })();
    return this.#putting;
  }

  /** One line per change between reachable and not. */
  #say(down: boolean, what: string): void {
    if (down === this.#down) return;
    this.#down = down;
    this.#log(`nixl-node worker ${this.#member.name}: ${what}`);
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
      this.#log(
        `nixl-node worker ${this.#member.name}: could not revoke its lease (${(e as Error).message}); it ends in ${this.#o.ttlSec ?? 5} s`,
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
export async function joinFleet(member: FleetMember, o: FleetJoinOptions): Promise<FleetRegistration> {
  return new FleetRegistration(member, o).join();
}
