// A Node inference worker for the serving proxy: the wiring between its
// listeners (listen.ts: HTTP or the proxy's ZeroMQ protocol, and a metrics
// port), its roles (roles.ts: encode, prefill, decode, aggregated) and its
// parts (parts.ts: the registered blocks, the holds, the KV mode picked once,
// the turns, made from options.ts). It starts and stops them, and says how it
// is: health, load, its record in a fleet.
import { randomUUID } from 'node:crypto';
import { contextFromTraceparent, startSpan } from '../../tracing';
import { type FleetRegistration, joinFleet } from '../fleet/registry';
import { silentLogger } from '../log';
import type { ServingModel } from '../models/types';
import type { WorkerParts } from './context';
import { answered, httpErrorOf, notAString } from './failures';
import type { FrontHandler, WorkerRequest } from './fronts/front';
import { KvEvents } from './kv-events';
import { Listeners } from './listen';
import type { WorkerOptions } from './options';
import { type Wired, makeParts } from './parts';
import { serve } from './roles';

/**
 * A Node inference worker: encoder, prefill, decode or aggregated, with the
 * synthetic model or a GGUF; KV moves by its KV mode (pull or push).
 */
export class Worker implements FrontHandler {
  readonly name: string;
  readonly stats: WorkerParts['stats'];
  readonly model: ServingModel;
  /** Bidirectional KV: turns held here and read from elsewhere (bidirectionalKv). */
  readonly turns?: WorkerParts['turns'];
  /** GET /metrics: vLLM's Prometheus series and nixl-node's; undefined without prom-client. @internal */
  readonly metrics?: Wired['metrics'];
  /** HTTP: the base URL; ZMQ: the address to PUSH to. */
  address = '';
  /** Its record in etcd, when given `etcd`. */
  fleet?: FleetRegistration;
  /** Its KV events publisher, when kvEvents enables one. @internal */
  kvEvents?: KvEvents;
  readonly #o: WorkerOptions;
  readonly #p: Wired;
  #listeners?: Listeners;
  #closed = false;
  /** Requests in progress (what it reports as its load). */
  #active = 0;

  /** A worker around a loaded model (startWorker loads it from the options). */
  constructor(o: WorkerOptions, model: ServingModel) {
    this.#o = o;
    this.model = model;
    this.name = o.name ?? `worker-${process.pid}-${randomUUID().slice(0, 8)}`;
    this.#p = makeParts(o, model, this.name, () => this.#active);
    this.stats = this.#p.stats;
    this.turns = this.#p.turns;
    this.metrics = this.#p.metrics;
  }

  /** The model's name in answers and /v1/models. */
  get modelId(): string {
    return this.#p.modelId;
  }

  /** Every name it answers to. */
  get servedModelNames(): readonly string[] {
    return this.#p.servedModelNames;
  }

  /** Where its metrics listener serves /metrics and /health (metricsPort), or undefined. */
  get metricsUrl(): string | undefined {
    return this.#listeners?.metricsUrl;
  }

  /** KV blocks free right now. */
  get freeBlocks(): number {
    return this.#p.blocks.available;
  }

  /** What /health (and a ZeroMQ HEALTH reply) says: the proxy pairs workers and checks max_tokens by it. */
  healthInfo(): ReturnType<FrontHandler['healthInfo']> {
    const len = this.model.contextSize;
    return {
      name: this.name,
      model: this.modelId,
      ...(len ? { max_model_len: len } : {}),
      free_blocks: this.freeBlocks,
      num_requests_waiting: this.#p.blocks.waiting,
      served_model_names: [...this.servedModelNames],
      ...(this.metricsUrl ? { metrics_url: this.metricsUrl } : {}),
      ...this.#p.handoff.health(),
      ...this.kvEvents?.health(),
      ...this.fleet?.health(),
    };
  }

  /** Why this worker cannot serve now (its model cannot), or undefined: /health answers 503 with it. */
  unhealthy(): string | undefined {
    return this.model.unhealthy?.();
  }

  /**
   * Frees at once the blocks a prefilled request holds, when its decode will
   * not read them (it failed, or the client went away): the proxy says so.
   */
  releaseHold(remoteRequestId: unknown): boolean {
    if (typeof remoteRequestId !== 'string') throw notAString('remote_request_id');
    return this.#p.holds.releaseHold(remoteRequestId);
  }

  /**
   * Frees the holds a request (the proxy's request id) made here, its turn
   * held for a next turn included, and makes its prefills still running give
   * theirs up: the proxy's client went away before the answer, with the
   * hold's id, reached the proxy. Returns how many holds and prefills it found.
   */
  releaseRequest(requestId: unknown): number {
    if (typeof requestId !== 'string') throw notAString('request_id');
    return this.#p.holds.releaseRequest(requestId);
  }

  /** Serves: the side channel, then the HTTP or ZeroMQ front. */
  async start(): Promise<this> {
    const o = this.#o;
    const host = o.host ?? '127.0.0.1';
    await this.#p.handoff.start({ host: o.sideChannelHost ?? host, port: o.sideChannelPort ?? 0 });
    this.kvEvents = await KvEvents.start(o.kvEvents, this.model, host, this.#p.blocks.size);
    this.#listeners = await Listeners.open(this, o, host);
    this.address = this.#listeners.address;
    if (o.etcd) this.fleet = await joinFleet(this.#fleetView(), o.etcd, o.logger);
    return this;
  }

  /** What its etcd record reports: load is requests in progress plus KV held for a decode. */
  #fleetView() {
    const w = this;
    const { blocks, holds } = this.#p;
    return {
      name: w.name,
      address: w.address,
      transport: w.#o.transport ?? 'http',
      modelId: w.modelId,
      servedModelNames: w.servedModelNames,
      get freeBlocks() {
        return w.freeBlocks;
      },
      totalBlocks: blocks.size,
      kvEvents: w.kvEvents?.info,
      get load() {
        // A request waiting for blocks counts twice: in progress, and queued behind a full cache.
        return w.#active + blocks.waiting + holds.count();
      },
    };
  }

  /** Counts a failed request; the error as the front answers it. */
  failed(e: unknown): ReturnType<FrontHandler['failed']> {
    this.stats.failed++;
    return answered(e);
  }

  /**
   * One request from a front, in its own span (a child of the proxy's stage
   * span when traceparent names one). Throws HttpError.
   */
  async handle(q: WorkerRequest): Promise<void> {
    const span = startSpan('worker.request', {
      kind: 'server',
      parent: contextFromTraceparent(q.traceparent),
      attributes: { 'http.route': q.path, 'nixl_node.worker': this.name, 'nixl_node.request_id': q.requestId },
    });
    this.#active++;
    const log = this.#o.logger ?? silentLogger;
    const t0 = performance.now();
    const fields = () => ({ request_id: q.requestId, route: q.path, ms: Math.round(performance.now() - t0) });
    try {
      await serve(this.#p, { ...q, sink: this.metrics?.track(q.sink) ?? q.sink }, span);
      log.debug({ ...fields(), status: 200 }, 'request');
    } catch (e) {
      const h = httpErrorOf(e, q.signal);
      span.fail(h);
      span.setAttribute('http.response.status_code', h.status);
      const line = { ...fields(), status: h.status, code: h.code, error: h.message };
      if (h.status >= 500) log.warn(line, 'request failed');
      else log.info(line, 'request refused');
      throw h;
    } finally {
      this.#active--;
      span.end();
    }
  }

  /** Stops: fronts closed, requests aborted, agent and model freed. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    const { blocks, holds, handoff, agent } = this.#p;
    // Out of the fleet first, then what is in progress (and KV held for a decode) finishes.
    await this.fleet?.leave(() => this.#active === 0 && holds.count('prefill') === 0);
    blocks.close();
    this.metrics?.close();
    await this.#listeners?.close();
    await handoff.close();
    agent.close();
    await this.kvEvents?.close();
    await this.model.close();
  }
}
