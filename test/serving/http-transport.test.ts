// The proxy's HTTP transport (undici's pooled Agent) and a stage's timeout
// signal: answers, streams, base paths, workers that cut or never answer,
// and connections reused across calls.
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { StageTimeout } from '../../lib/serving/proxy/stage-signal';
import { HttpTransport } from '../../lib/serving/proxy/transports/http';
import { TransportError, type StageCall } from '../../lib/serving/proxy/transports/types';
import type { WorkerRef } from '../../lib/serving/proxy/pool';

const servers: http.Server[] = [];
afterEach(async () => {
  for (const s of servers.splice(0)) {
    s.closeAllConnections();
    await new Promise((r) => s.close(r));
  }
});

async function serve(h: http.RequestListener): Promise<{ url: string; connections: () => number }> {
  let n = 0;
  const s = http.createServer(h);
  s.on('connection', () => n++);
  servers.push(s);
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  return { url: `http://127.0.0.1:${(s.address() as AddressInfo).port}`, connections: () => n };
}

const call = (address: string, o: Partial<StageCall> = {}): StageCall => ({
  stage: 'prefill',
  worker: { address } as WorkerRef,
  path: '/v1/completions',
  body: { prompt: 'hi' },
  requestId: 'r-1',
  signal: new AbortController().signal,
  stream: false,
  ...o,
});

describe('HttpTransport', () => {
  it('posts the body with the request id and max tokens, under the base path, on kept-alive connections', async () => {
    const seen: Array<{ url?: string; id?: string; max?: string; body: string }> = [];
    const w = await serve((q, s) => {
      let body = '';
      q.on('data', (c) => (body += c));
      q.on('end', () => {
        seen.push({
          url: q.url,
          id: q.headers['x-request-id'] as string,
          max: q.headers['x-nixl-node-decode-max-tokens'] as string,
          body,
        });
        s.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ ok: seen.length }));
      });
    });
    const t = new HttpTransport();
    try {
      for (let i = 1; i <= 6; i++) {
        const a = await t.call(call(`${w.url}/base`, { decodeMaxTokens: 7 }));
        expect(a).toEqual({ status: 200, json: { ok: i } });
      }
      expect(seen[0]).toEqual({ url: '/base/v1/completions', id: 'r-1', max: '7', body: '{"prompt":"hi"}' });
      // Kept alive: calls one after another reuse connections (undici may open a second while the first settles).
      expect(w.connections()).toBeLessThanOrEqual(2);
    } finally {
      await t.close();
    }
  });

  it('gives a stream as chunks, and a worker error body as it came', async () => {
    const w = await serve((q, s) => {
      if (q.url === '/bad/v1/completions') return void s.writeHead(503).end('not json');
      s.writeHead(200, { 'content-type': 'text/event-stream' });
      s.end('data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n');
    });
    const t = new HttpTransport();
    try {
      const a = await t.call(call(w.url, { stream: true }));
      const got: unknown[] = [];
      for await (const c of a.chunks!) got.push(c);
      expect(got).toEqual([{ n: 1 }, { n: 2 }]);
      const b = await t.call(call(`${w.url}/bad`));
      expect(b.status).toBe(503);
      expect((b.json!.error as { message: string }).message).toMatch(/HTTP 503 with no JSON: not json/);
    } finally {
      await t.close();
    }
  });

  it('a worker that cuts the connection, one not listening, and an aborted call are TransportErrors', async () => {
    const w = await serve((q) => q.socket.destroy());
    const t = new HttpTransport();
    try {
      await expect(t.call(call(w.url))).rejects.toBeInstanceOf(TransportError);
      const dead = await serve(() => {});
      const url = dead.url;
      await new Promise((r) => servers.pop()!.close(r));
      await expect(t.call(call(url))).rejects.toThrow(/ECONNREFUSED/);
      const hang = await serve(() => {});
      const ac = new AbortController();
      const p = t.call(call(hang.url, { signal: ac.signal }));
      setTimeout(() => ac.abort(new Error('client gone')), 50);
      const e = await p.catch((x: unknown) => x);
      expect(e).toBeInstanceOf(TransportError);
      expect((e as TransportError).aborted).toBe(true);
    } finally {
      await t.close();
    }
  });
});

describe('StageTimeout', () => {
  it('aborts when the time is up, saying so', async () => {
    const s = new StageTimeout(new AbortController().signal, 20);
    await new Promise((r) => s.signal.addEventListener('abort', r));
    expect(s.aborted).toBe(true);
    expect((s.signal.reason as Error).name).toBe('TimeoutError');
  });

  it("aborts with the client's reason when the client goes, which is not a timeout", () => {
    const client = new AbortController();
    const s = new StageTimeout(client.signal, 60_000);
    const why = new Error('client disconnected');
    client.abort(why);
    expect(s.signal.reason).toBe(why);
    expect(s.aborted).toBe(false);
    s.end({ end() {} });
    const gone = new StageTimeout(client.signal, 60_000);
    expect(gone.signal.aborted).toBe(true);
    gone.end({ end() {} });
  });

  it('once ended, neither the timer nor the client aborts it, and the span is ended', async () => {
    const client = new AbortController();
    const s = new StageTimeout(client.signal, 10);
    let ended = 0;
    s.end({ end: () => ended++ });
    await new Promise((r) => setTimeout(r, 40));
    client.abort();
    expect([s.signal.aborted, s.aborted, ended]).toEqual([false, false, 1]);
  });
});
