// Tracing through @opentelemetry/api only: an optional peer dependency, loaded
// on first use. The application (or the nixl-node command) installs an SDK and
// an exporter; without one the API's tracer is a no-op, and without the API
// package every call here is a cheap no-op of our own. W3C trace context
// (`traceparent`) is written and read here, so the proxy's and the workers'
// spans form one trace whatever propagator (if any) the application set.
import type * as Otel from '@opentelemetry/api';

/** A span as this package uses it (the API's Span, or a no-op). */
export interface SpanLike {
  /** Sets an attribute. */
  setAttribute(key: string, value: string | number | boolean): unknown;
  /** Records an event. */
  addEvent(name: string, attributes?: Record<string, string | number | boolean>): unknown;
  /** Ends it as failed: status ERROR, the exception, and the NixlError code when there is one. */
  fail(e: unknown): void;
  /** Ends the span. */
  end(): void;
  /** The W3C traceparent of this span, for a child in another process. */
  traceparent(): string | undefined;
  /** Opaque: the context a child span starts from. */
  readonly context: TraceContext;
}

/** An opaque trace context (the API's Context when it is installed). */
export type TraceContext = object;

let api: typeof Otel | null | undefined;
let enabled = true;

/**
 * Turns every span of this package off (false) or back on: off, nothing is
 * asked of @opentelemetry/api at all. On by default.
 */
export function setTracing(on: boolean): void {
  enabled = on;
}

function otel(): typeof Otel | null {
  if (!enabled) return null;
  if (api === undefined) {
    try {
      api = require('@opentelemetry/api') as typeof Otel;
    } catch {
      api = null;
    }
  }
  return api;
}

const NOOP_CONTEXT: TraceContext = Object.freeze({});
const NOOP: SpanLike = {
  setAttribute: () => undefined,
  addEvent: () => undefined,
  fail: () => undefined,
  end: () => undefined,
  traceparent: () => undefined,
  context: NOOP_CONTEXT,
};

class OtelSpan implements SpanLike {
  readonly context: TraceContext;
  #ended = false;

  constructor(
    readonly api: typeof Otel,
    readonly span: Otel.Span,
    parent: Otel.Context,
  ) {
    this.context = api.trace.setSpan(parent, span);
  }

  setAttribute(key: string, value: string | number | boolean): unknown {
    return this.span.setAttribute(key, value);
  }

  addEvent(name: string, attributes?: Record<string, string | number | boolean>): unknown {
    return this.span.addEvent(name, attributes);
  }

  fail(e: unknown): void {
    const err = e as { message?: string; code?: unknown };
    if (typeof err?.code === 'string') this.span.setAttribute('nixl.error.code', err.code);
    if (e instanceof Error) this.span.recordException(e);
    this.span.setStatus({ code: this.api.SpanStatusCode.ERROR, message: err?.message ?? String(e) });
  }

  end(): void {
    if (this.#ended) return;
    this.#ended = true;
    this.span.end();
  }

  traceparent(): string | undefined {
    const c = this.span.spanContext();
    if (!this.api.trace.isSpanContextValid(c)) return undefined;
    return `00-${c.traceId}-${c.spanId}-${(c.traceFlags & 1).toString(16).padStart(2, '0')}`;
  }
}

/** Options of a span: its kind, its parent and its first attributes. */
export interface SpanOptions {
  /** The parent: a span's context, or one read from a traceparent. Default: the active context. */
  parent?: TraceContext;
  attributes?: Record<string, string | number | boolean | undefined>;
  kind?: 'server' | 'client' | 'internal';
}

/** Starts a span of the 'nixl-node' tracer (a no-op when nothing is installed). */
export function startSpan(name: string, o: SpanOptions = {}): SpanLike {
  const a = otel();
  if (!a) return NOOP;
  const parent = (o.parent as Otel.Context | undefined) ?? a.context.active();
  const attributes: Otel.Attributes = {};
  for (const [k, v] of Object.entries(o.attributes ?? {})) if (v !== undefined) attributes[k] = v;
  const kind = o.kind === 'server' ? a.SpanKind.SERVER : o.kind === 'client' ? a.SpanKind.CLIENT : a.SpanKind.INTERNAL;
  const span = a.trace.getTracer('nixl-node').startSpan(name, { attributes, kind }, parent);
  return new OtelSpan(a, span, parent);
}

/** Runs fn in a child span, ending it (failed when fn throws). */
export async function inSpan<T>(name: string, o: SpanOptions, fn: (span: SpanLike) => Promise<T>): Promise<T> {
  const span = startSpan(name, o);
  try {
    return await fn(span);
  } catch (e) {
    span.fail(e);
    throw e;
  } finally {
    span.end();
  }
}

const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** The context a W3C traceparent names (its span as a remote parent); undefined when absent or malformed. */
export function contextFromTraceparent(tp: unknown): TraceContext | undefined {
  const a = otel();
  if (!a || typeof tp !== 'string') return undefined;
  const m = TRACEPARENT.exec(tp.trim());
  if (!m || /^0+$/.test(m[1]) || /^0+$/.test(m[2])) return undefined;
  return a.trace.setSpanContext(a.ROOT_CONTEXT, {
    traceId: m[1],
    spanId: m[2],
    traceFlags: Number.parseInt(m[3], 16) & 1,
    isRemote: true,
  });
}
