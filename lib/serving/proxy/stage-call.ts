// One stage of a request on one worker: the pick, its timeout, its span and
// metric, and, when the worker fails it in a way another worker may not,
// the same stage again on another worker. What a failure means (retry,
// eject, the client's status once retries run out) is read from the one
// failure table, api/errors.ts. Both KV handoffs run their legs through it.
import { type TraceContext, startSpan } from '../../tracing';
import { FAILURES, type FailureRule, ruleOf } from '../api/errors';
import type { HealthRounds } from './health';
import type { ProxyMetrics, ProxyStats } from './metrics';
import type { Stage, WorkerPool, WorkerRef } from './pool';
import { StageTimeout } from './stage-signal';
import type { StageAnswer, WorkerTransport } from './transports/types';

/** A stage that failed: what the client is answered (status, stage, worker, the worker's error type). */
export class StageFailure extends Error {
  /** What the failure table says of it: whether another worker (or a fresh prefill) may do better. */
  readonly rule: FailureRule;

  constructor(
    readonly status: number,
    readonly stage: Stage,
    readonly worker: string | undefined,
    message: string,
    /** The worker's error type, when it answered one (kv_expired: prefill again). */
    readonly type?: string,
    rule?: FailureRule,
  ) {
    super(message);
    this.rule = rule ?? ruleOf(type, status);
  }

  /** What a span records as the error code: the worker's code, else the stage and status. */
  get code(): string {
    return this.type ?? `stage_failed_${this.status}`;
  }
}

/** A stage's answer and the worker that gave it; release() once done with it (a stream: at its end). */
export interface StageResult {
  answer: StageAnswer;
  worker: WorkerRef;
  release(): void;
}

/** One client request as its stages see it. */
export interface ProxyRequest {
  path: string;
  body: Record<string, unknown>;
  /** The proxy's own id, sent to the workers (unique in flight: prefills free holds by it). */
  requestId: string;
  /** The client's: aborted when it goes away. */
  signal: AbortSignal;
  /** The request's span: its stages' spans are its children. */
  trace?: TraceContext;
  /** The prefill's prefix-affinity key ('load' and 'precise' policies). */
  affinity?: string | object;
  /** Its conversation_id (bidirectional KV). */
  conversation?: string;
}

/** What one stage call is asked. */
export interface StageAsk {
  stage: Stage;
  body: Record<string, unknown>;
  /** The answer is an SSE stream. */
  stream?: boolean;
  /** Other workers to try after one fails (default 0). */
  retries?: number;
  /** Workers not to pick. */
  avoid?: ReadonlySet<WorkerRef>;
  /** Only workers this accepts. */
  accept?: (w: WorkerRef) => boolean;
  /** Prefill: the max_tokens its decode will generate (the worker refuses a prompt that cannot fit them). */
  decodeMaxTokens?: number;
  /** Instead of the client's signal (push: both legs abort together). */
  signal?: AbortSignal;
}

export interface StageCallerDeps {
  pools: Readonly<Record<Stage, WorkerPool>>;
  transport: WorkerTransport;
  health: HealthRounds;
  stats: ProxyStats;
  prom?: ProxyMetrics;
  /** Per stage, ms (default 60 s each). */
  timeoutMs?: Partial<Record<Stage, number>>;
}

/** Runs stages on workers, and frees what a worker holds for a request the proxy gives up on. */
export class StageCaller {
  readonly pools: Readonly<Record<Stage, WorkerPool>>;
  readonly stats: ProxyStats;
  readonly #d: StageCallerDeps;

  constructor(d: StageCallerDeps) {
    this.#d = d;
    this.pools = d.pools;
    this.stats = d.stats;
  }

  /** One stage on one worker, run again on others (up to `retries`) while the table says another may do better. */
  async call(r: ProxyRequest, a: StageAsk): Promise<StageResult> {
    const pool = this.pools[a.stage];
    const tried = new Set<WorkerRef>(a.avoid);
    const retries = a.retries ?? 0;
    let last: StageFailure | undefined;
    for (let attempt = 0; attempt <= retries; attempt++) {
      const w = pool.pick(tried, a.stage === 'prefill' ? r.affinity : undefined, a.accept);
      if (!w || (attempt > 0 && tried.has(w))) break;
      tried.add(w);
      if (attempt > 0) this.stats.retries++;
      const out = await this.#attempt(r, a, w, attempt);
      if (!(out instanceof StageFailure)) return out;
      last = out;
      if (!out.rule.retry) break;
    }
    throw last ?? new StageFailure(503, a.stage, undefined, `no healthy ${a.stage} worker`);
  }

  /** One round of health checks that only learns what the workers say of themselves. */
  learn(): Promise<void> {
    return this.#d.health.check({ learnOnly: true });
  }

  /** Tells a worker to free the KV it holds under `remoteRequestId` now (best effort: its lease frees it anyway). */
  release(w: WorkerRef, remoteRequestId: string): void {
    this.stats.holdsReleased++;
    void this.#d.transport.release(w, remoteRequestId);
  }

  /** Tells a worker to free whatever it holds or is prefilling for our request id (its hold's id never came). */
  releaseRequest(w: WorkerRef, requestId: string): void {
    this.stats.holdsReleased++;
    void this.#d.transport.releaseRequest(w, requestId);
  }

  /** One try on `w`: its answer, or a failure the loop may try elsewhere; throws when the client went away. */
  async #attempt(r: ProxyRequest, a: StageAsk, w: WorkerRef, attempt: number): Promise<StageResult | StageFailure> {
    const { stage } = a;
    const span = startSpan(`proxy.${stage}`, {
      kind: 'client',
      parent: r.trace,
      attributes: {
        'nixl_node.stage': stage,
        'nixl_node.worker': w.address,
        'nixl_node.attempt': attempt,
        'nixl_node.retry': attempt > 0,
      },
    });
    const timeout = new StageTimeout(a.signal ?? r.signal, this.#timeoutMs(stage));
    const t0 = performance.now();
    w.outstanding++;
    let released = false;
    let streaming = false;
    const release = () => {
      if (released) return;
      released = true;
      w.outstanding--;
      if (streaming) timeout.end(span); // a streamed answer's span and timeout last to its end
    };
    const observe = (outcome: string) =>
      this.#d.prom?.stageSeconds.observe({ stage, outcome }, (performance.now() - t0) / 1000);
    try {
      const answer = await this.#d.transport.call({
        stage,
        worker: w,
        path: r.path,
        body: a.body,
        requestId: r.requestId,
        signal: timeout.signal,
        stream: a.stream ?? false,
        traceparent: span.traceparent(),
        decodeMaxTokens: a.decodeMaxTokens,
      });
      observe(String(answer.status));
      span.setAttribute('http.response.status_code', answer.status);
      if (answer.status >= 400) {
        release();
        const f = refused(stage, w, answer);
        span.fail(f);
        return f;
      }
      if (!answer.chunks) release();
      else streaming = true;
      return { answer, worker: w, release };
    } catch (e) {
      release();
      if (!(a.signal ?? r.signal).aborted) observe(timeout.aborted ? 'timeout' : 'unreachable');
      const f = this.#unanswered(e, r, a, w, timeout);
      span.fail(f ?? e);
      if (!f) throw e;
      return f;
    } finally {
      if (!streaming) timeout.end(span);
    }
  }

  /** No answer came: undefined when the client went away (the caller rethrows), else the failure. */
  #unanswered(e: unknown, r: ProxyRequest, a: StageAsk, w: WorkerRef, timeout: StageTimeout): StageFailure | undefined {
    const { stage } = a;
    const gone = (a.signal ?? r.signal).aborted;
    // A prefill (or a decode, of its turn) may have answered into the connection just
    // cut: its hold's id never arrived, so it is released by our request id instead.
    if (gone ? stage !== 'encode' : stage === 'prefill' && timeout.aborted) this.releaseRequest(w, r.requestId);
    if (gone) return undefined;
    // Nothing came back yet, so another worker may take it (a ZeroMQ peer that died says nothing).
    const ms = this.#timeoutMs(stage);
    const cause = (e as Error).message;
    const rule: FailureRule = timeout.aborted ? FAILURES.stage_timeout : FAILURES.unreachable;
    if (rule.eject) this.#d.health.eject(w, timeout.aborted ? `no answer within ${ms} ms` : `unreachable: ${cause}`);
    const message = timeout.aborted ? `did not answer within ${ms} ms` : `failed: ${cause}`;
    return new StageFailure(
      rule.exhausted ?? rule.status,
      stage,
      w.address,
      `${stage} worker ${w.address} ${message}`,
      undefined,
      rule,
    );
  }

  #timeoutMs(stage: Stage): number {
    return this.#d.timeoutMs?.[stage] ?? 60_000;
  }
}

/**
 * A worker's error answer, read by the failure table. An answer, whatever
 * its status, comes from a worker that is up: a refusal of this request (bad
 * KV, a pull that failed, a lease run out) says nothing of the next one, so
 * it never ejects. A 4xx is the request's fault and goes to the client as it
 * is; a 5xx may do better elsewhere.
 */
function refused(stage: Stage, w: WorkerRef, answer: StageAnswer): StageFailure {
  const err = answer.json?.error as { message?: string; type?: string; code?: string } | undefined;
  const msg = err?.message ?? `HTTP ${answer.status}`;
  // HTTP workers say it as OpenAI's error type, ZeroMQ ones as code.
  const type = err?.type ?? err?.code;
  const rule = answeredRule(type, answer.status);
  const message =
    answer.status < 500
      ? `${stage} worker ${w.address}: ${msg}`
      : `${stage} worker ${w.address} answered ${answer.status}: ${msg}`;
  return new StageFailure(rule.exhausted ?? answer.status, stage, w.address, message, type, rule);
}

/** The table's rule for an error answer; a known type with a status of the other class (4xx, 5xx) is read by its status. */
function answeredRule(type: string | undefined, status: number): FailureRule {
  const r = ruleOf(type, status);
  return r.status >= 500 === status >= 500 ? r : ruleOf(undefined, status);
}
