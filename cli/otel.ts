// Tracing for the nixl-node command: with --otlp-endpoint URL (or the standard
// OTEL_EXPORTER_OTLP_ENDPOINT), spans go to <URL>/v1/traces as OTLP over HTTP
// with JSON bodies, under service.name nixl-node-proxy / nixl-node-worker. The
// library depends on @opentelemetry/api only; the SDK and the exporter are the
// package's optional dependencies, loaded here and only then. Batches are
// flushed before exit. An endpoint from the environment never stops a
// process: when it cannot be used, one warning line and no tracing.
import type * as Api from '@opentelemetry/api';
import type * as Exporter from '@opentelemetry/exporter-trace-otlp-http';
import type * as Resources from '@opentelemetry/resources';
import type * as Sdk from '@opentelemetry/sdk-trace-base';
import { UsageError } from './args';
import type { Logger } from '../lib/serving/log';

const PACKAGES = [
  '@opentelemetry/api',
  '@opentelemetry/sdk-trace-base',
  '@opentelemetry/exporter-trace-otlp-http',
  '@opentelemetry/resources',
];

/** Starts exporting when an endpoint is given; returns what flushes and stops it. */
export function startTracing(endpoint: string | undefined, serviceName: string, log: Logger): () => Promise<void> {
  const base = endpoint ?? process.env.OTEL_EXPORTER_OTLP_ENDPOINT;
  if (!base) return async () => {};
  // --otlp-endpoint was asked for: a usage error. The environment's: a warning.
  const refuse = (why: string): (() => Promise<void>) => {
    if (endpoint !== undefined) throw new UsageError(why);
    log.warn({ OTEL_EXPORTER_OTLP_ENDPOINT: base }, `tracing off: ${why}`);
    return async () => {};
  };
  let url: URL;
  try {
    url = new URL(`${base.replace(/\/+$/, '')}/v1/traces`);
  } catch {
    return refuse(`the OTLP endpoint must be a URL, got '${base}'`);
  }
  let api: typeof Api;
  let sdk: typeof Sdk;
  let exporter: typeof Exporter;
  let resources: typeof Resources;
  try {
    api = require('@opentelemetry/api');
    sdk = require('@opentelemetry/sdk-trace-base');
    exporter = require('@opentelemetry/exporter-trace-otlp-http');
    resources = require('@opentelemetry/resources');
  } catch {
    return refuse(
      `tracing to ${base} needs the OpenTelemetry SDK, an optional dependency left out of this install: npm install ${PACKAGES.join(' ')}`,
    );
  }
  const provider = new sdk.BasicTracerProvider({
    resource: resources.resourceFromAttributes({ 'service.name': serviceName }),
    spanProcessors: [
      new sdk.BatchSpanProcessor(new exporter.OTLPTraceExporter({ url: url.href }), { scheduledDelayMillis: 1000 }),
    ],
  });
  api.trace.setGlobalTracerProvider(provider);
  return async () => {
    await provider.forceFlush();
    await provider.shutdown();
  };
}
