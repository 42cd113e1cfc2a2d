// Tracing for the nixl-node command: with --otlp-endpoint URL (or the standard
// OTEL_EXPORTER_OTLP_ENDPOINT), spans go to <URL>/v1/traces as OTLP over HTTP
// with JSON bodies, under service.name nixl-node-proxy / nixl-node-worker. The
// library depends on @opentelemetry/api only; the SDK and the exporter are
// optional, loaded here and only then. Batches are flushed before exit.
import type * as Api from '@opentelemetry/api';
import type * as Exporter from '@opentelemetry/exporter-trace-otlp-http';
import type * as Resources from '@opentelemetry/resources';
import type * as Sdk from '@opentelemetry/sdk-trace-base';
import { UsageError } from './args';

const PACKAGES = [
  '@opentelemetry/api',
  '@opentelemetry/sdk-trace-base',
  '@opentelemetry/exporter-trace-otlp-http',
  '@opentelemetry/resources',
];

/** Starts exporting when an endpoint is given; returns what flushes and stops it. */
export function startTracing(endpoint: string | undefined, serviceName: string): () => Promise<void> {
  const base = endpoint ?? process.env.OTEL_EXPORTER_OTLP_ENDPOINT;
  if (!base) return async () => {};
  let url: URL;
  try {
    url = new URL(`${base.replace(/\/+$/, '')}/v1/traces`);
  } catch {
    throw new UsageError(`--otlp-endpoint must be a URL, got '${base}'`);
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
    throw new UsageError(`tracing to ${base} needs the OpenTelemetry SDK: npm install ${PACKAGES.join(' ')}`);
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
