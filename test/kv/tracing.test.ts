// One trace per request across proxy, prefill and decode (issue 21): the
// client's traceparent is the proxy span's parent, each stage is a child of
// it, the workers' spans are children of their stage (traceparent over HTTP,
// a field over ZeroMQ), and the KV hold and pull sit inside. An in-memory
// exporter collects what the library's spans would export.
import { trace } from '@opentelemetry/api';
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  type ReadableSpan,
  SimpleSpanProcessor,
} from '@opentelemetry/sdk-trace-base';
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { start } from '../../dist/demo/serving';
import { NixlAgent } from '../../lib';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';
import { contextFromTraceparent, startSpan } from '../../lib/tracing';
import { ROOT, serveTrio } from '../helpers';

const exporter = new InMemorySpanExporter();
const provider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
beforeAll(() => {
  trace.setGlobalTracerProvider(provider);
});
afterAll(async () => {
  await provider.shutdown();
  trace.disable();
});
const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
  exporter.reset();
});

const CLIENT_TRACE = '4bf92f3577b34da6a3ce929d0e0e4736';
const CLIENT_SPAN = '00f067aa0ba902b7';

/** The spans of the client's trace (a hold of an earlier test may end during this one). */
function spans(): ReadableSpan[] {
  return exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === CLIENT_TRACE);
}
const parentOf = (s: ReadableSpan) => s.parentSpanContext?.spanId;
const idOf = (s: ReadableSpan) => s.spanContext().spanId;
function one(name: string, pred: (s: ReadableSpan) => boolean = () => true): ReadableSpan {
  const found = spans().filter((s) => s.name === name && pred(s));
  expect(
    found.map((s) => s.name),
    `${name}: ${spans()
      .map((s) => s.name)
      .join(', ')}`,
  ).toHaveLength(1);
  return found[0];
}

describe.each(['http', 'zmq'] as const)('a traced request over %s', (transport) => {
  it('one trace: client -> proxy.request -> stage spans -> worker spans -> the KV hold and pull', async () => {
    const { prefill, proxy } = await serveTrio(closers, {
      transport,
      prefill: { name: `tp-${transport}` },
      decode: { name: `td-${transport}` },
    });
    const r = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      headers: {
        'content-type': 'application/json',
        traceparent: `00-${CLIENT_TRACE}-${CLIENT_SPAN}-01`,
        'x-request-id': 'client-7',
      },
      body: JSON.stringify({ model: MODEL_NAME, prompt: 'trace me please', max_tokens: 3 }),
    });
    expect(r.status).toBe(200);
    await r.json();
    // The hold ends when the decode's read frees the blocks.
    await expect.poll(() => spans().some((s) => s.name === 'kv.hold'), { timeout: 3000 }).toBe(true);

    const root = one('proxy.request');
    expect(parentOf(root)).toBe(CLIENT_SPAN);
    expect(root.attributes).toMatchObject({
      'http.route': '/v1/completions',
      'http.response.status_code': 200,
      'gen_ai.request.model': MODEL_NAME,
      'nixl_node.request_id': 'client-7',
    });
    const pre = one('proxy.prefill');
    const dec = one('proxy.decode');
    for (const s of [pre, dec]) expect(parentOf(s)).toBe(idOf(root));
    expect(pre.attributes).toMatchObject({
      'nixl_node.worker': prefill.address,
      'nixl_node.attempt': 0,
      'nixl_node.retry': false,
    });
    const wPre = one('worker.request', (s) => s.attributes['nixl_node.role'] === 'prefill');
    const wDec = one('worker.request', (s) => s.attributes['nixl_node.role'] === 'decode');
    expect(parentOf(wPre)).toBe(idOf(pre));
    expect(parentOf(wDec)).toBe(idOf(dec));
    const hold = one('kv.hold');
    expect(parentOf(hold)).toBe(idOf(wPre));
    expect(hold.attributes['nixl_node.release_reason']).toBe('read');
    const pull = one('kv.pull');
    expect(parentOf(pull)).toBe(idOf(wDec));
    // The workers' agents use the default engine (NIXL_NODE_ENGINE, else nixl when compiled in).
    const probe = new NixlAgent('engine-probe');
    const engine = probe.engine;
    probe.close();
    expect(pull.attributes).toMatchObject({
      'nixl_node.engine': engine,
      'nixl_node.remote_ranks': '0',
    });
    expect(pull.attributes['nixl_node.bytes']).toBeGreaterThan(0);
    // The backend that served it, as NIXL's queryXferBackend names it.
    expect(pull.attributes['nixl_node.backend']).toBe(engine === 'nixl' ? 'UCX' : 'LOOPBACK');
    for (const name of ['kv.handshake', 'kv.post', 'kv.transfer', 'kv.confirm', 'kv.notify'])
      expect(parentOf(one(name))).toBe(idOf(pull));
    expect(one('kv.handshake').attributes['nixl_node.cached']).toBe(false);
    expect(one('kv.transfer').attributes['nixl_node.descriptors']).toBeGreaterThan(0);
    // Every span is inside its parent's time.
    for (const s of spans()) {
      const p = spans().find((x) => idOf(x) === parentOf(s));
      if (p && s.name !== 'kv.hold')
        expect(s.startTime[0] * 1e9 + s.startTime[1]).toBeGreaterThanOrEqual(p.startTime[0] * 1e9 + p.startTime[1]);
    }
  });

  it('a failing stage shows its error on its span, with the code', async () => {
    const { proxy } = await serveTrio(closers, {
      transport,
      decode: { testHooks: { stallDecodeMs: 2000 } },
      proxy: { timeoutMs: { decode: 300 } },
    });
    const r = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: 'slow', max_tokens: 2 }),
    });
    expect(r.status).toBe(504);
    await r.json();
    const all = exporter.getFinishedSpans();
    const failed = all.filter((s) => s.name === 'proxy.decode');
    expect(failed.length).toBeGreaterThan(0);
    expect(failed[0].status.code).toBe(2); // ERROR
    expect(failed[0].status.message).toMatch(/did not answer within 300 ms/);
    expect(failed[0].attributes['nixl.error.code']).toBe('stage_failed_504');
    const root = all.filter((s) => s.name === 'proxy.request');
    expect(root).toHaveLength(1);
    expect(root[0].status.code).toBe(2);
    expect(root[0].attributes['http.response.status_code']).toBe(504);
  });
});

describe('trace context', () => {
  it('reads a W3C traceparent, refuses malformed ones, writes its own', () => {
    expect(contextFromTraceparent('00-00000000000000000000000000000000-00f067aa0ba902b7-01')).toBeUndefined();
    expect(contextFromTraceparent('garbage')).toBeUndefined();
    expect(contextFromTraceparent(42)).toBeUndefined();
    const ctx = contextFromTraceparent(`00-${CLIENT_TRACE}-${CLIENT_SPAN}-01`);
    const s = startSpan('child', { parent: ctx });
    expect(s.traceparent()).toMatch(new RegExp(`^00-${CLIENT_TRACE}-[0-9a-f]{16}-01$`));
    s.end();
  });
});

describe('the nixl-node command exports its spans (OTLP/HTTP, JSON)', () => {
  it('proxy and workers with --otlp-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT): one trace arrives, flushed at SIGTERM', async () => {
    const bodies: Array<{ type: string; body: Record<string, unknown> }> = [];
    const receiver = http.createServer((req, res) => {
      let text = '';
      req.on('data', (d) => (text += d));
      req.on('end', () => {
        if (req.url === '/v1/traces')
          bodies.push({ type: String(req.headers['content-type']), body: JSON.parse(text) });
        res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
      });
    });
    await new Promise<void>((r) => receiver.listen(0, '127.0.0.1', () => r()));
    closers.push(() => new Promise((r) => receiver.close(r)));
    const endpoint = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}`;
    const procs: ChildProcess[] = [];
    closers.push(() => {
      for (const p of procs) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
    });
    const spawned = (p: ChildProcess) => procs.push(p);
    const pre = await start(['worker', '--otlp-endpoint', endpoint], spawned);
    // The standard variable works as well as the flag.
    process.env.OTEL_EXPORTER_OTLP_ENDPOINT = endpoint;
    const dec = await start(['worker'], spawned).finally(() => delete process.env.OTEL_EXPORTER_OTLP_ENDPOINT);
    const proxy = await start(
      [
        'proxy',
        '--port',
        '0',
        '--prefill',
        String(pre.ready.address),
        '--decode',
        String(dec.ready.address),
        '--otlp-endpoint',
        endpoint,
      ],
      spawned,
    );
    const r = await fetch(`${proxy.ready.url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', traceparent: `00-${CLIENT_TRACE}-${CLIENT_SPAN}-01` },
      body: JSON.stringify({ prompt: 'exported', max_tokens: 2 }),
    });
    expect(r.status).toBe(200);
    await r.text();
    for (const p of procs) {
      const exited = new Promise((res) => p.once('exit', res));
      p.kill('SIGTERM');
      await exited;
    }
    const services = new Map<string, string[]>();
    for (const { type, body } of bodies) {
      expect(type).toMatch(/application\/json/);
      for (const rs of body.resourceSpans as Array<{
        resource: { attributes: Array<{ key: string; value: { stringValue?: string } }> };
        scopeSpans: Array<{ spans: Array<{ name: string; traceId: string }> }>;
      }>) {
        const service = rs.resource.attributes.find((a) => a.key === 'service.name')?.value.stringValue ?? '?';
        for (const ss of rs.scopeSpans)
          for (const s of ss.spans)
            if (s.traceId === CLIENT_TRACE) services.set(service, [...(services.get(service) ?? []), s.name]);
      }
    }
    expect(services.get('nixl-node-proxy')).toEqual(
      expect.arrayContaining(['proxy.request', 'proxy.prefill', 'proxy.decode']),
    );
    expect(services.get('nixl-node-worker')).toEqual(
      expect.arrayContaining(['worker.request', 'kv.hold', 'kv.pull', 'kv.transfer']),
    );
  }, 30_000);

  it('without the SDK installed: one line naming the packages, exit code 2', async () => {
    const r = spawnSync(process.execPath, ['-e', NO_SDK, ROOT], { encoding: 'utf8', timeout: 20_000 });
    expect(r.status, r.stderr).toBe(2);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(r.stderr).toMatch(
      /needs the OpenTelemetry SDK, an optional dependency left out of this install: npm install @opentelemetry\/api @opentelemetry\/sdk-trace-base/,
    );
  });

  it('OTEL_EXPORTER_OTLP_ENDPOINT in the environment never stops a worker: one warning line instead', async () => {
    for (const [env, why] of [
      ['http://127.0.0.1:9', /tracing off: tracing to http:\/\/127\.0\.0\.1:9 needs the OpenTelemetry SDK/],
      ['not a url', /tracing off: the OTLP endpoint must be a URL/],
    ] as const) {
      const p = spawn(process.execPath, ['-e', NO_SDK.replace("'--otlp-endpoint', 'http://127.0.0.1:9'", ''), ROOT], {
        env: { ...process.env, OTEL_EXPORTER_OTLP_ENDPOINT: env },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      let err = '';
      p.stdout!.on('data', (d) => (out += d));
      p.stderr!.on('data', (d) => (err += d));
      await expect.poll(() => out.includes('"ready":true'), { timeout: 15_000 }).toBe(true);
      p.kill('SIGTERM');
      expect(await new Promise((r) => p.once('exit', r))).toBe(0);
      const warnings = err
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l) as { level: number; msg: string })
        .filter((l) => l.level >= 40);
      expect(warnings).toHaveLength(1);
      expect(warnings[0].msg).toMatch(why);
    }
  }, 40_000);
});

// Runs `nixl-node worker --otlp-endpoint ...` with the SDK packages hidden from require.
const NO_SDK = `
const Module = require('node:module');
const resolve = Module._resolveFilename;
Module._resolveFilename = function (req, ...rest) {
  if (/^@opentelemetry\\/(sdk-trace-base|exporter-trace-otlp-http|resources)$/.test(req)) {
    const e = new Error("Cannot find module '" + req + "'");
    e.code = 'MODULE_NOT_FOUND';
    throw e;
  }
  return resolve.call(this, req, ...rest);
};
const root = process.argv[1];
process.argv = [process.argv[0], 'nixl-node', 'worker', '--otlp-endpoint', 'http://127.0.0.1:9'];
require(root + '/bin/nixl-node.js');
`;
