// A worker's metrics listener (--metrics-port, startWorker({ metricsPort })):
// a ZeroMQ worker has no HTTP front, so this is where Prometheus scrapes its
// vLLM series; it serves GET /metrics and /health only, answers anything else
// as the fronts do (404, 405 with Allow), and the worker says where it is in
// its health answers and the command's ready line.
import { type ChildProcess, spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { startProxy, startWorker } from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';
import { ROOT } from '../helpers';
import { expectVllmSeries, families, sample } from './vllm-series';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

describe('a ZeroMQ P/D pair with metrics ports', () => {
  it("after a request through the proxy, both workers' metrics ports serve vLLM's series", async () => {
    const mk = (name: string) => startWorker({ name, transport: 'zmq', blocks: 64, metricsPort: 0 });
    const [prefill, decode] = await Promise.all([mk('zm-P'), mk('zm-D')]);
    cleanup.push(
      () => prefill.close(),
      () => decode.close(),
    );
    const proxy = await startProxy({
      transport: 'zmq',
      prefill: [prefill.address],
      decode: [decode.address],
      healthIntervalMs: 0,
    });
    cleanup.push(() => proxy.close());
    expect(decode.metricsUrl).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    const r = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        model: MODEL_NAME,
        prompt: 'a prompt long enough for a few blocks '.repeat(4),
        max_tokens: 4,
      }),
    });
    expect(r.status).toBe(200);
    await r.json();
    for (const w of [prefill, decode]) {
      const res = await fetch(`${w.metricsUrl}/metrics`);
      expect(res.status).toBe(200);
      expect(res.headers.get('content-type')).toMatch(/^text\/plain/);
      const f = expectVllmSeries(await res.text());
      expect(f.get('nixl_node_transfers_total')?.type).toBe('counter');
    }
    // The decode pulled the KV (pull mode: the side that posts the READ counts it) and answered.
    const d = families(await (await fetch(`${decode.metricsUrl}/metrics`)).text());
    expect(sample(d, 'vllm:nixl_xfer_time_seconds', 'vllm:nixl_xfer_time_seconds_count')).toBeGreaterThan(0);
    expect(sample(d, 'vllm:e2e_request_latency_seconds', 'vllm:e2e_request_latency_seconds_count')).toBe(1);
    // /health on the metrics port, and the health answers of either front, say where the port is.
    const h = await fetch(`${decode.metricsUrl}/health`);
    expect(h.status).toBe(200);
    expect(await h.json()).toMatchObject({ status: 'ok', name: 'zm-D', metrics_url: decode.metricsUrl });
    expect(decode.healthInfo().metrics_url).toBe(decode.metricsUrl);
  });

  it('serves /metrics and /health only: other paths 404, other methods 405 with Allow', async () => {
    const w = await startWorker({ name: 'zm-routes', transport: 'zmq', blocks: 16, metricsPort: 0 });
    cleanup.push(() => w.close());
    const miss = await fetch(`${w.metricsUrl}/v1/completions`, { method: 'POST', body: '{}' });
    expect(miss.status).toBe(404);
    expect(((await miss.json()) as { error: { code: string } }).error.code).toBe('not_found');
    const post = await fetch(`${w.metricsUrl}/metrics`, { method: 'POST', body: 'x' });
    expect(post.status).toBe(405);
    expect(post.headers.get('allow')).toBe('GET');
    expect((await fetch(`${w.metricsUrl}/metrics`)).status).toBe(200);
  });

  it("an HTTP worker's metrics port serves beside its API port, which keeps /metrics", async () => {
    const w = await startWorker({ name: 'http-mp', blocks: 16, metricsPort: 0 });
    cleanup.push(() => w.close());
    expect(w.metricsUrl).not.toBe(w.address);
    for (const base of [w.address, w.metricsUrl]) expectVllmSeries(await (await fetch(`${base}/metrics`)).text());
    expect(((await (await fetch(`${w.address}/health`)).json()) as { metrics_url: string }).metrics_url).toBe(
      w.metricsUrl,
    );
  });

  it('a port already taken fails the start with EADDRINUSE, nothing left listening', async () => {
    const a = await startWorker({ name: 'mp-a', transport: 'zmq', blocks: 16, metricsPort: 0 });
    cleanup.push(() => a.close());
    const port = Number(new URL(a.metricsUrl!).port);
    await expect(startWorker({ name: 'mp-b', transport: 'zmq', blocks: 16, metricsPort: port })).rejects.toMatchObject({
      code: 'EADDRINUSE',
    });
  });
});

describe('nixl-node worker --metrics-port', () => {
  const procs: ChildProcess[] = [];
  afterAll(() => {
    for (const p of procs) if (p.exitCode === null) p.kill('SIGKILL');
  });

  it('a zmq worker says where its metrics port is in its ready line, and serves there', async () => {
    const p = spawn(
      process.execPath,
      [path.join(ROOT, 'bin', 'nixl-node.js'), 'worker', '--transport', 'zmq', '--metrics-port', '0'],
      { stdio: ['ignore', 'pipe', 'pipe'] },
    );
    procs.push(p);
    const ready = await new Promise<Record<string, string>>((resolve, reject) => {
      readline.createInterface({ input: p.stdout! }).once('line', (l) => resolve(JSON.parse(l)));
      p.once('exit', (c) => reject(new Error(`worker exited ${c}`)));
    });
    expect(ready.address).toMatch(/^tcp:\/\//);
    expect(ready.metrics_url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    expectVllmSeries(await (await fetch(`${ready.metrics_url}/metrics`)).text());
  });
});
