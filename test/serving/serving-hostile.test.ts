// What a hostile or careless client or peer sends the proxy and the workers
// (issue 30): fields we do not serve, oversized headers, reply addresses a
// ZeroMQ worker cannot use, clients that hang up during the prefill; issue
// 44: OpenAI fields not served are refused by name, and unknown paths and
// methods get one answer from the proxy and the workers.
import * as fs from 'node:fs';
import * as net from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import type { ChildProcess } from 'node:child_process';
import { start } from '../../dist/demo/serving';
import { startProxy, startWorker } from '../../lib/serving';
import { decodeMessage, encodeMessage } from '../../lib/serving/api/zmq-protocol';
import { freePort, serveTrio } from '../helpers';

const closers: Array<() => unknown> = [];
const procs: ChildProcess[] = [];
afterEach(async () => {
  for (const p of procs.splice(0)) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
  for (const c of closers.splice(0).reverse()) await c();
});

async function post(url: string, body: unknown, headers: Record<string, string> = {}) {
  const r = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
  });
  const text = await r.text();
  let json: Record<string, unknown> = {};
  try {
    json = JSON.parse(text);
  } catch {
    /* not JSON */
  }
  return { status: r.status, json };
}

/** The status line a raw HTTP/1.1 request gets (fetch cannot send a 70 KB header). */
function rawStatus(url: string, head: string): Promise<number> {
  const u = new URL(url);
  return new Promise((resolve, reject) => {
    const s = net.connect(Number(u.port), u.hostname, () => s.write(head));
    let got = '';
    s.on('data', (d) => {
      got += d.toString('latin1');
      const m = /^HTTP\/1\.1 (\d{3})/.exec(got);
      if (m) {
        resolve(Number(m[1]));
        s.destroy();
      }
    });
    s.on('error', reject);
    s.on('close', () => reject(new Error(`closed with no status: ${JSON.stringify(got.slice(0, 80))}`)));
  });
}

describe('one choice per request', () => {
  it("'n' other than 1 is a 400 invalid_request_error from the proxy and from a worker, on both routes", async () => {
    const { proxy, decode } = await serveTrio(closers);
    const routes = [
      ['/v1/completions', { prompt: 'pick one' }],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: 'pick one' }] }],
    ] as const;
    for (const base of [proxy.url, decode.address]) {
      for (const [route, body] of routes) {
        for (const n of [2, 0, -1, 'x', 1.5, [1]]) {
          const r = await post(`${base}${route}`, { ...body, max_tokens: 4, n });
          expect(r.status, `${base}${route} n=${JSON.stringify(n)}`).toBe(400);
          const e = r.json.error as { message: string; type: string };
          expect(e.type).toBe('invalid_request_error');
          expect(e.message).toMatch(/'n'/);
        }
        for (const n of [1, undefined]) {
          const r = await post(`${base}${route}`, { ...body, max_tokens: 4, n });
          expect(r.status, `n=${n}`).toBe(200);
          expect((r.json.choices as unknown[]).length).toBe(1);
        }
      }
    }
    expect(proxy.pools.decode.workers[0].healthy).toBe(true);
  });
});

describe('OpenAI fields that are not served (issue 44)', () => {
  const chat = { messages: [{ role: 'user', content: 'fields' }], max_tokens: 3 };
  const completion = { prompt: 'fields', max_tokens: 3 };
  // What asks for something not served: a 400 naming the field, from the proxy and from a worker.
  const refused: Array<[string, unknown, 'chat' | 'completion' | 'both']> = [
    ['logprobs', true, 'chat'],
    ['logprobs', 2, 'completion'],
    ['logprobs', 0, 'completion'],
    ['top_logprobs', 3, 'chat'],
    ['tools', [{ type: 'function', function: { name: 'f', parameters: {} } }], 'chat'],
    ['tool_choice', 'required', 'chat'],
    ['tool_choice', { type: 'function', function: { name: 'f' } }, 'chat'],
    ['response_format', { type: 'json_object' }, 'both'],
    ['response_format', { type: 'json_schema', json_schema: { name: 'x', schema: {} } }, 'chat'],
    ['logit_bias', { '50256': -100 }, 'both'],
    ['frequency_penalty', 0.5, 'both'],
    ['presence_penalty', -1, 'both'],
    ['echo', true, 'completion'],
    ['best_of', 3, 'completion'],
    ['suffix', 'tail', 'completion'],
    ['top_k', 5, 'both'],
    ['ignore_eos', true, 'both'],
    ['min_tokens', 2, 'both'],
    ['guided_json', { type: 'object' }, 'both'],
    ['modalities', ['text', 'audio'], 'chat'],
    // vLLM keeps a salted prefix cache apart; one shared cache must not pretend to.
    ['cache_salt', 'tenant-a', 'both'],
  ];
  // What asks for nothing: OpenAI's and vLLM's defaults, sent by clients that always send every field.
  const harmless: Record<string, unknown> = {
    logprobs: false,
    top_logprobs: 0,
    tools: [],
    tool_choice: 'none',
    response_format: { type: 'text' },
    logit_bias: {},
    frequency_penalty: 0,
    presence_penalty: 0,
    top_k: -1,
    ignore_eos: false,
    n: 1,
    user: 'someone',
    metadata: { team: 'x' },
    parallel_tool_calls: true,
    seed: 7,
    stop: ['never-in-the-answer'],
  };

  it('a field that asks for what is not served is a 400 naming it (param); its no-op values are served', async () => {
    const { proxy, decode } = await serveTrio(closers);
    for (const base of [proxy.url, decode.address]) {
      for (const [field, value, where] of refused) {
        for (const [route, body] of [
          ['/v1/chat/completions', chat],
          ['/v1/completions', completion],
        ] as const) {
          if (where !== 'both' && (where === 'chat') !== route.includes('chat')) continue;
          const r = await post(`${base}${route}`, { ...body, [field]: value });
          const what = `${base}${route} ${field}=${JSON.stringify(value)}`;
          expect(r.status, what).toBe(400);
          expect(r.json.error, what).toMatchObject({
            type: 'invalid_request_error',
            param: field,
            code: 'unsupported_parameter',
            message: expect.stringContaining(`'${field}'`),
          });
        }
      }
      for (const [route, body] of [
        ['/v1/chat/completions', chat],
        ['/v1/completions', { ...completion, logprobs: null, echo: false, best_of: 1, suffix: null }],
      ] as const) {
        const r = await post(`${base}${route}`, { ...body, ...harmless });
        expect(r.status, `${base}${route} ${JSON.stringify(r.json)}`).toBe(200);
        // tool_choice 'auto' with no tools asks for nothing either.
        expect((await post(`${base}${route}`, { ...body, tool_choice: 'auto' })).status).toBe(200);
      }
    }
    // A client's 400 never takes a worker out of the pool.
    expect(proxy.pools.decode.workers[0].healthy).toBe(true);
  });

  it('cache_salt on the generate endpoint is refused too (the prefix cache is shared), null is served', async () => {
    const { proxy, decode } = await serveTrio(closers);
    const body = { token_ids: [72, 105, 33], sampling_params: { max_tokens: 2 } };
    for (const base of [proxy.url, decode.address]) {
      const r = await post(`${base}/inference/v1/generate`, { ...body, cache_salt: 'tenant-a' });
      expect(r.status, base).toBe(400);
      expect(r.json.error).toMatchObject({ param: 'cache_salt', code: 'unsupported_parameter' });
    }
    expect((await post(`${proxy.url}/inference/v1/generate`, { ...body, cache_salt: null })).status).toBe(200);
  });
});

describe('unknown paths and wrong methods (issue 44)', () => {
  it('the proxy and a worker answer alike: 404 for a path neither serves, 405 with Allow for another method', async () => {
    const { proxy, decode } = await serveTrio(closers);
    for (const base of [proxy.url, decode.address]) {
      for (const [method, path] of [
        ['GET', '/nope'],
        ['POST', '/nope'],
        ['GET', '/v2/completions'],
        ['DELETE', '/v1'],
      ]) {
        const r = await fetch(`${base}${path}`, { method });
        expect(r.status, `${base} ${method} ${path}`).toBe(404);
        expect(((await r.json()) as { error: { message: string } }).error.message).toMatch(/no route/);
      }
      for (const [method, path, allow] of [
        ['GET', '/v1/completions', 'POST'],
        ['PUT', '/v1/chat/completions', 'POST'],
        ['GET', '/inference/v1/generate', 'POST'],
        ['POST', '/health', 'GET'],
        ['DELETE', '/v1/models', 'GET'],
      ]) {
        const r = await fetch(`${base}${path}`, { method });
        expect(r.status, `${base} ${method} ${path}`).toBe(405);
        expect(r.headers.get('allow')).toBe(allow);
        const e = ((await r.json()) as { error: { message: string; type: string } }).error;
        expect(e.type).toBe('invalid_request_error');
        expect(e.message).toContain(allow);
      }
    }
    // /metrics (Prometheus) is served by both, on GET only.
    expect((await fetch(`${decode.address}/metrics`)).status).toBe(200);
    for (const base of [decode.address, proxy.url])
      expect((await fetch(`${base}/metrics`, { method: 'POST' })).headers.get('allow')).toBe('GET');
  });
});

describe('oversized headers', () => {
  it('a 70 KB header is 431 from the proxy and from a worker; the next request is served', async () => {
    const { proxy, decode } = await serveTrio(closers);
    const body = JSON.stringify({ prompt: 'x', max_tokens: 2 });
    const head = (host: string) =>
      `POST /v1/completions HTTP/1.1\r\nHost: ${host}\r\nContent-Type: application/json\r\n` +
      `X-Big: ${'a'.repeat(70 << 10)}\r\nContent-Length: ${body.length}\r\n\r\n${body}`;
    for (const url of [proxy.url, decode.address]) {
      expect(await rawStatus(url, head(new URL(url).host)), url).toBe(431);
      expect((await post(`${url}/v1/completions`, { prompt: 'x', max_tokens: 2 })).status).toBe(200);
    }
  });
});

describe('reply_to of a ZeroMQ worker', () => {
  const fds = () => fs.readdirSync('/proc/self/fd').length;

  it('garbage, udp:// and 1,100 distinct addresses: answers dropped and counted, sockets bounded, the worker serving', async () => {
    const w = await startWorker({ transport: 'zmq', blocks: 64 });
    closers.push(() => w.close());
    const replies = new zmq.Pull({ linger: 0 });
    await replies.bind('tcp://127.0.0.1:*');
    const push = new zmq.Push({ linger: 0 });
    push.connect(w.address);
    closers.push(
      () => replies.close(),
      () => push.close(),
    );
    const send = (tag: 'HEALTH' | 'GENERATION', body: Record<string, unknown>) =>
      push.send(encodeMessage(tag, body as never));
    /** A HEALTH answered on our socket: the worker is alive and serving. */
    const healthy = async (id: string) => {
      await send('HEALTH', { msg_id: id, reply_to: replies.lastEndpoint });
      const { body } = decodeMessage(await replies.receive());
      expect(body).toMatchObject({ msg_id: id, ok: true });
    };
    await healthy('h0');
    const before = fds();
    const bad = ['garbage', 'udp://127.0.0.1:5555', 'tcp://', 'tcp://127.0.0.1', 'ipc://', '', 'x'.repeat(5000)];
    for (const [i, reply_to] of bad.entries()) {
      await send('HEALTH', { msg_id: `bad-${i}`, reply_to });
      await send('GENERATION', {
        msg_id: `gen-${i}`,
        reply_to,
        path: '/v1/completions',
        payload: { prompt: 'x', max_tokens: 2 },
      });
    }
    await healthy('h1');
    expect(w.stats.repliesDropped).toBe(2 * bad.length);
    // Addresses ZeroMQ takes but where nobody listens (loopback ports 1..1100): sockets
    // that would each hold a descriptor and retry for good.
    for (let i = 0; i < 1100; i++) await send('HEALTH', { msg_id: `many-${i}`, reply_to: `tcp://127.0.0.1:${1 + i}` });
    await healthy('h2');
    // The same address again and again: one socket.
    for (let i = 0; i < 300; i++) await healthy(`again-${i}`);
    const grown = fds() - before;
    expect(grown, `${grown} descriptors more than before`).toBeLessThan(150);
    expect(w.stats.repliesDropped).toBe(2 * bad.length);
    await w.close();
    // Closing the worker closes its reply sockets.
    await expect.poll(() => fds() - before, { timeout: 2000 }).toBeLessThan(20);
  }, 60_000);
});

describe.each(['http', 'zmq'] as const)('clients that hang up during the prefill (%s)', (transport) => {
  it('50 cuts 2-29 ms in: every block of the prefill is free within a second, not at the lease', async () => {
    const at = (p: number) => (transport === 'http' ? ['--port', String(p)] : ['--zmq-addr', `tcp://127.0.0.1:${p}`]);
    const worker = async (blocks: number) =>
      start(['worker', '--blocks', String(blocks), '--transport', transport, ...at(await freePort())], (p) =>
        procs.push(p),
      );
    const [pre, dec] = await Promise.all([worker(300), worker(1024)]);
    const proxy = await startProxy({
      transport,
      prefill: [String(pre.ready.address)],
      decode: [String(dec.ready.address)],
      healthIntervalMs: 0,
    });
    closers.push(() => proxy.close());
    const stats = async () => {
      const n = pre.lines.length;
      pre.p.kill('SIGUSR2');
      await expect.poll(() => pre.lines.length, { timeout: 2000, interval: 10 }).toBeGreaterThan(n);
      const l = pre.lines.filter((x) => x.stats).at(-1) as { freeBlocks: number; stats: Record<string, number> };
      return { free: l.freeBlocks, ...l.stats };
    };
    const prompt = (i: number) => `cut ${i}: ${'the lazy dog jumps over '.repeat(4 + (i % 4))}`;
    const ok = await post(`${proxy.url}/v1/completions`, { prompt: prompt(0), max_tokens: 4 });
    expect(ok.status).toBe(200);
    for (let i = 0; i < 50; i++) {
      const ac = new AbortController();
      const t = setTimeout(() => ac.abort(), 2 + ((i * 7) % 28));
      await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: prompt(i), max_tokens: 4 }),
        signal: ac.signal,
      })
        .then((r) => r.text())
        .catch(() => undefined);
      clearTimeout(t);
    }
    const t0 = performance.now();
    let last: Record<string, number> = {};
    // The lease is 30 s: back within about a second means released.
    await expect
      .poll(
        async () => {
          last = await stats();
          return last.free;
        },
        { timeout: 1200, interval: 50 },
      )
      .toBe(300);
    console.log(`cuts (${transport}): free after ${Math.round(performance.now() - t0)} ms`, JSON.stringify(last));
    expect((await post(`${proxy.url}/v1/completions`, { prompt: prompt(1), max_tokens: 4 })).status).toBe(200);
  }, 30_000);
});
