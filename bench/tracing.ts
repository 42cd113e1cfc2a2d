// The serving proxy's throughput with tracing off, on with the API's no-op
// tracer (@opentelemetry/api installed, no SDK), and exporting (the SDK with a
// batch processor and the OTLP/HTTP exporter to a local receiver). The proxy
// and one prefill and one decode worker run in this process, so every span of
// a request is made here. Modes alternate round by round; each figure is the
// median of the rounds, each ratio the median of the rounds' ratios to 'off'.
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { startProxy, startWorker } from '../lib/serving';
import { setTracing } from '../lib/tracing';
import { median } from './stats';

export interface TracingRow {
  mode: string;
  requestsPerSecond: number;
  min: number;
  max: number;
  ratio: number;
}

type Api = typeof import('@opentelemetry/api');

export async function benchTracing(requests: number, rounds: number): Promise<{ rows: TracingRow[]; note?: string }> {
  let api: Api | undefined;
  try {
    api = require('@opentelemetry/api') as Api;
  } catch {
    return { rows: [], note: 'skipped: @opentelemetry/api is not installed' };
  }
  const exporting = await exportingProvider();
  const prefill = await startWorker({ blocks: 1024 });
  const decode = await startWorker({ blocks: 1024 });
  const proxy = await startProxy({ prefill: [prefill.address], decode: [decode.address], healthIntervalMs: 0 });
  const modes: Array<[string, () => void]> = [
    ['off', () => setTracing(false)],
    [
      'no-op tracer',
      () => {
        setTracing(true);
        api.trace.disable();
      },
    ],
  ];
  if (exporting)
    modes.push([
      'exporting',
      () => {
        setTracing(true);
        api.trace.disable();
        api.trace.setGlobalTracerProvider(exporting.provider);
      },
    ]);
  const rps = new Map<string, number[]>(modes.map(([m]) => [m, []]));
  try {
    await load(proxy.url, 50); // warm
    for (let r = 0; r < rounds; r++)
      for (const [mode, set] of modes) {
        set();
        const t0 = performance.now();
        await load(proxy.url, requests);
        rps.get(mode)!.push((requests / (performance.now() - t0)) * 1000);
        await exporting?.provider.forceFlush();
      }
  } finally {
    setTracing(true);
    api.trace.disable();
    await proxy.close();
    await prefill.close();
    await decode.close();
    await exporting?.close();
  }
  const off = rps.get('off')!;
  const rows = modes.map(([mode]) => {
    const xs = rps.get(mode)!;
    return {
      mode,
      requestsPerSecond: median(xs),
      min: Math.min(...xs),
      max: Math.max(...xs),
      ratio: median(xs.map((x, i) => x / off[i])),
    };
  });
  return { rows, note: exporting ? undefined : 'exporting row skipped: the OpenTelemetry SDK is not installed' };
}

/** 16 clients, `n` completions in all. */
async function load(url: string, n: number): Promise<void> {
  let next = 0;
  const client = async () => {
    while (next < n) {
      const i = next++;
      const r = await fetch(`${url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: `bench ${i % 7}: the quick brown fox`, max_tokens: 4 }),
      });
      if (r.status !== 200) throw new Error(`bench request answered ${r.status}: ${await r.text()}`);
      await r.arrayBuffer();
    }
  };
  await Promise.all(Array.from({ length: 16 }, client));
}

async function exportingProvider() {
  let sdk: typeof import('@opentelemetry/sdk-trace-base');
  let exporter: typeof import('@opentelemetry/exporter-trace-otlp-http');
  try {
    sdk = require('@opentelemetry/sdk-trace-base');
    exporter = require('@opentelemetry/exporter-trace-otlp-http');
  } catch {
    return undefined;
  }
  // A receiver that reads and drops every batch, as a collector on this host would take them.
  const receiver = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => res.writeHead(200, { 'content-type': 'application/json' }).end('{}'));
  });
  await new Promise<void>((r) => receiver.listen(0, '127.0.0.1', () => r()));
  const url = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/v1/traces`;
  const provider = new sdk.BasicTracerProvider({
    spanProcessors: [new sdk.BatchSpanProcessor(new exporter.OTLPTraceExporter({ url }))],
  });
  return {
    provider,
    close: async () => {
      await provider.shutdown();
      await new Promise((r) => receiver.close(r));
    },
  };
}
