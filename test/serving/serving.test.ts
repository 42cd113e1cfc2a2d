// The disaggregated-serving proxy end to end on both worker transports:
// answers checked against the synthetic model, 4xx for bad requests, a
// client disconnect aborting the stage in flight, workers killed mid-request
// (prefill retried elsewhere; a dead decode's KV freed by the prefill's
// lease), health checks, and 200 concurrent requests.
import { type ChildProcess, spawn } from 'node:child_process';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import { type ServingProxy, type Worker, startProxy, startWorker } from '../../lib/serving';
import { WorkerPool } from '../../lib/serving/proxy/pool';
import { encodeMessage } from '../../lib/serving/api/zmq-protocol';
import { MODEL_NAME, expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import { ROOT } from '../helpers';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

async function cluster(
  transport: 'http' | 'zmq',
  opts: { prefill?: number; decode?: number; leaseMs?: number; proxy?: object } = {},
) {
  const mk = (name: string) => startWorker({ name, transport, blocks: 1024, leaseMs: opts.leaseMs });
  const prefill = await Promise.all(Array.from({ length: opts.prefill ?? 2 }, (_, i) => mk(`P${i}-${transport}`)));
  const decode = await Promise.all(Array.from({ length: opts.decode ?? 2 }, (_, i) => mk(`D${i}-${transport}`)));
  for (const w of [...prefill, ...decode]) cleanup.push(() => w.close());
  const proxy = await startProxy({
    transport,
    prefill: prefill.map((w) => w.address),
    decode: decode.map((w) => w.address),
    healthIntervalMs: 0,
    ...opts.proxy,
  });
  cleanup.push(() => proxy.close());
  return { proxy, prefill, decode };
}

async function complete(
  proxy: ServingProxy,
  i: number,
  o: { chat?: boolean; stream?: boolean; maxTokens?: number } = {},
) {
  const text = `prompt number ${i}: ${'lorem ipsum '.repeat(i % 9)}`;
  const maxTokens = o.maxTokens ?? 6;
  const body = o.chat
    ? {
        model: MODEL_NAME,
        messages: [{ role: 'user', content: text }],
        max_tokens: maxTokens,
        stream: o.stream ?? false,
      }
    : { model: MODEL_NAME, prompt: text, max_tokens: maxTokens, stream: o.stream ?? false };
  const r = await fetch(`${proxy.url}${o.chat ? '/v1/chat/completions' : '/v1/completions'}`, {
    method: 'POST',
    headers: { 'x-request-id': `req-${i}` },
    body: JSON.stringify(body),
  });
  let got = '';
  let verified = 0;
  if (o.stream) {
    expect(r.headers.get('content-type')).toMatch(/text\/event-stream/);
    const sse = await r.text();
    expect(sse.endsWith('data: [DONE]\n\n')).toBe(true);
    for (const line of sse.split('\n').filter((l) => l.startsWith('data: {'))) {
      const c = JSON.parse(line.slice(6));
      got += o.chat ? (c.choices[0].delta.content ?? '') : c.choices[0].text;
      verified += c.nixl_node?.verified_bytes ?? 0;
    }
  } else {
    const j = await r.json();
    expect(r.status, JSON.stringify(j)).toBe(200);
    got = o.chat ? j.choices[0].message.content : j.choices[0].text;
    verified = j.nixl_node.verified_bytes;
  }
  return {
    status: r.status,
    requestId: r.headers.get('x-request-id'),
    got,
    want: expectedCompletion(o.chat ? `user: ${text}` : text, maxTokens).join(' '),
    verified,
  };
}

describe.each(['http', 'zmq'] as const)('proxy over %s', (transport) => {
  it('completions and chat, streamed and not: the answer comes from the right KV', async () => {
    const { proxy, prefill, decode } = await cluster(transport);
    for (const [i, o] of [
      [1, {}],
      [2, { chat: true }],
      [3, { stream: true }],
      [4, { chat: true, stream: true }],
    ] as const) {
      const r = await complete(proxy, i, o);
      expect(r.got).toBe(r.want);
      expect(r.requestId).toBe(`req-${i}`);
      expect(r.verified).toBeGreaterThan(0);
    }
    expect(prefill.reduce((a, w) => a + w.stats.prefills, 0)).toBe(4);
    expect(decode.reduce((a, w) => a + w.stats.decodes, 0)).toBe(4);
    // Round-robin spread the work; the prefills' blocks came back after the reads.
    expect(prefill.every((w) => w.stats.prefills === 2)).toBe(true);
    await expect.poll(() => prefill.reduce((a, w) => a + w.stats.freedByRead, 0)).toBe(4);
    expect(prefill.every((w) => w.freeBlocks === 1024)).toBe(true);
    const health = await fetch(`${proxy.url}/health`);
    expect(health.status).toBe(200);
    const metrics = await (await fetch(`${proxy.url}/metrics`)).text();
    expect(metrics).toMatch(/nixl_node_proxy_requests_total\{route="\/v1\/completions",status="200"\} 2/);
    expect(metrics).toMatch(/nixl_node_proxy_stage_seconds_count\{stage="prefill",outcome="200"\} 4/);
  });

  it('200 concurrent requests: nothing lost or mixed up', async () => {
    const { proxy } = await cluster(transport, { proxy: { policy: 'least-outstanding' } });
    const rs = await Promise.all(
      Array.from({ length: 200 }, (_, i) => complete(proxy, i, { chat: i % 3 === 0, stream: i % 2 === 0 })),
    );
    rs.forEach((r, i) => {
      expect(r.status).toBe(200);
      expect(r.requestId).toBe(`req-${i}`);
      expect(r.got).toBe(r.want);
    });
    expect(proxy.stats).toMatchObject({ requests: 200, completed: 200, failed: 0 });
  }, 60_000);

  it('a client that disconnects aborts the stage in flight', async () => {
    const slow = await startWorker({
      name: `slowP-${transport}`,
      transport,
      testHooks: { stallPrefillMs: 5000 },
      leaseMs: 500,
    });
    const d = await startWorker({ name: `D-${transport}`, transport });
    cleanup.push(
      () => slow.close(),
      () => d.close(),
    );
    const proxy = await startProxy({ transport, prefill: [slow.address], decode: [d.address], healthIntervalMs: 0 });
    cleanup.push(() => proxy.close());
    const ac = new AbortController();
    const req = fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: 'x'.repeat(100) }),
      signal: ac.signal,
    }).catch((e) => e);
    await expect.poll(() => slow.freeBlocks < 512).toBe(true); // the prefill started
    ac.abort();
    expect(await req).toBeInstanceOf(Error);
    await expect.poll(() => proxy.stats.aborted).toBe(1);
    // The worker saw it go: its prefill failed (aborted) instead of answering after 5 s...
    await expect.poll(() => slow.stats.failed, { timeout: 3000 }).toBe(1);
    expect(slow.stats.prefills).toBe(0);
    // ...and the KV it computed is freed at once (not at the 30 s lease), since no decode will read it.
    await expect.poll(() => slow.freeBlocks, { timeout: 3000 }).toBe(512);
    expect(slow.stats.abortedHolds).toBe(1);
    expect(slow.stats.freedByLease).toBe(0);
  });
});

describe.each(['http', 'zmq'] as const)('encoder stage (%s)', (transport) => {
  it('requests with images go to an encoder first; the others do not', async () => {
    const enc = await startWorker({ name: `E-${transport}`, transport });
    cleanup.push(() => enc.close());
    const { proxy } = await cluster(transport, { prefill: 1, decode: 1, proxy: { encode: [enc.address] } });
    const messages = [
      {
        role: 'user',
        content: [
          { type: 'text', text: 'what is in' },
          { type: 'image_url', image_url: { url: 'data:image/png;base64,AAAA' } },
        ],
      },
    ];
    const r = await fetch(`${proxy.url}/v1/chat/completions`, {
      method: 'POST',
      body: JSON.stringify({ messages, max_tokens: 4 }),
    });
    const j = await r.json();
    expect(r.status, JSON.stringify(j)).toBe(200);
    expect(j.choices[0].message.content).toBe(
      expectedCompletion('user: what is in <image data:image/png;base64,AAAA>', 4).join(' '),
    );
    expect(enc.stats.encodes).toBe(1);
    await complete(proxy, 7, { chat: true });
    expect(enc.stats.encodes).toBe(1);
  });
});

describe('requests the proxy refuses (4xx), and it stays up', () => {
  it('garbage, oversized, malformed, unknown routes, wrong methods, a missing token', async () => {
    const { proxy } = await cluster('http', {
      prefill: 1,
      decode: 1,
      proxy: { bearerToken: 'tok', maxBodyBytes: 4096 },
    });
    const auth = { authorization: 'Bearer tok' };
    const post = (p: string, body: string, headers: Record<string, string> = auth) =>
      fetch(`${proxy.url}${p}`, { method: 'POST', headers, body });
    const cases: Array<[Promise<Response>, number, RegExp]> = [
      [post('/v1/completions', '{not json'), 400, /not JSON/],
      [post('/v1/completions', '[1,2]'), 400, /JSON object/],
      [post('/v1/completions', JSON.stringify({ prompt: 5 })), 400, /'prompt' must be a string/],
      [post('/v1/chat/completions', JSON.stringify({ messages: [] })), 400, /non-empty array/],
      [post('/v1/chat/completions', JSON.stringify({ messages: [{ content: 'x' }] })), 400, /role/],
      [post('/v1/completions', JSON.stringify({ prompt: 'x', max_tokens: 0 })), 400, /max_tokens/],
      [post('/v1/completions', JSON.stringify({ prompt: 'x', stream: 'yes' })), 400, /stream/],
      [post('/v1/completions', JSON.stringify({ prompt: 'x', kv_transfer_params: {} })), 400, /set by the proxy/],
      [post('/v1/completions', JSON.stringify({ prompt: 'x'.repeat(10_000) })), 413, /larger than 4096/],
      [post('/v1/completions', JSON.stringify({ prompt: 'x' }), {}), 401, /bearer token/],
      [post('/v2/nope', '{}'), 404, /no route/],
      [fetch(`${proxy.url}/v1/completions`, { headers: auth }), 405, /POST/],
    ];
    for (const [p, status, re] of cases) {
      const r = await p;
      expect(r.status).toBe(status);
      expect((await r.json()).error.message).toMatch(re);
      expect(r.headers.get('x-request-id')).toMatch(/^[0-9a-f-]{36}$/); // made when not given
    }
    // Raw garbage on the socket.
    const answer = await new Promise<string>((resolve) => {
      const s = require('node:net').connect(Number(new URL(proxy.url).port), '127.0.0.1', () =>
        s.write('\x00\x01garbage\r\n\r\n'),
      );
      let out = '';
      s.on('data', (d: Buffer) => (out += d));
      s.on('close', () => resolve(out));
    });
    expect(answer).toMatch(/^HTTP\/1.1 400/);
    const ok = await post('/v1/completions', JSON.stringify({ prompt: 'still up', max_tokens: 2 }));
    expect(ok.status).toBe(200);
    expect(proxy.stats.failed).toBe(0);
  });
});

// ---- real worker processes, killed mid-request ---------------------------------

const BIN = path.join(ROOT, 'bin', 'nixl-node.js');

async function workerProcess(args: string[]): Promise<{ p: ChildProcess; address: string }> {
  const p = spawn(process.execPath, [BIN, 'worker', ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  cleanup.push(() => {
    if (p.exitCode === null) p.kill('SIGKILL');
  });
  const address = await new Promise<string>((resolve, reject) => {
    readline.createInterface({ input: p.stdout! }).on('line', (l) => {
      if (l.startsWith('{"ready"')) resolve(JSON.parse(l).address);
    });
    p.once('exit', (c) => reject(new Error(`worker exited ${c}`)));
  });
  return { p, address };
}

describe.each(['http', 'zmq'] as const)('workers killed mid-request (%s)', (transport) => {
  it('a prefill worker killed before it answers: the prefill stage is retried on another worker', async () => {
    const doomed = await workerProcess(['--transport', transport, '--stall-prefill-ms', '10000']);
    const good = await startWorker({ name: `goodP-${transport}`, transport });
    const d = await startWorker({ name: `D-kill-${transport}`, transport });
    cleanup.push(
      () => good.close(),
      () => d.close(),
    );
    const proxy = await startProxy({
      transport,
      prefill: [doomed.address, good.address],
      decode: [d.address],
      healthIntervalMs: 0,
      timeoutMs: { prefill: transport === 'zmq' ? 1500 : 10_000 },
    });
    cleanup.push(() => proxy.close());
    const pending = fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: 'kill me', max_tokens: 3 }),
    });
    await new Promise((r) => setTimeout(r, 300)); // round-robin sent it to the doomed worker first
    doomed.p.kill('SIGKILL');
    const r = await pending;
    const j = await r.json();
    // HTTP: the connection broke, and the proxy retries at once. ZeroMQ says nothing when a
    // peer dies: the stage times out (1.5 s here), and then it is retried on the other worker.
    expect(r.status, JSON.stringify(j)).toBe(200);
    expect(j.choices[0].text).toBe(expectedCompletion('kill me', 3).join(' '));
    expect(proxy.stats.retries).toBe(1);
    expect(proxy.pools.prefill.workers[0].healthy).toBe(false);
    await proxy.checkHealth();
    expect(proxy.pools.prefill.workers.map((w) => w.healthy)).toEqual([false, true]);
    const after = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: 'after', max_tokens: 2 }),
    });
    expect(after.status).toBe(200);
  }, 30_000);

  it('a decode worker killed mid-request: a 502/504 naming the stage and worker; the prefill frees the KV at once', async () => {
    const p = await startWorker({ name: `P-lease-${transport}`, transport, leaseMs: 1000 });
    cleanup.push(() => p.close());
    const doomed = await workerProcess(['--transport', transport, '--stall-decode-ms', '10000']);
    const proxy = await startProxy({
      transport,
      prefill: [p.address],
      decode: [doomed.address],
      healthIntervalMs: 0,
      timeoutMs: { decode: 2000 },
    });
    cleanup.push(() => proxy.close());
    const pending = fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: 'y'.repeat(200) }),
    });
    await expect.poll(() => p.stats.prefills).toBe(1);
    expect(p.freeBlocks).toBeLessThan(512);
    doomed.p.kill('SIGKILL');
    const r = await pending;
    expect([502, 504]).toContain(r.status);
    expect((await r.json()).error).toMatchObject({ stage: 'decode', worker: doomed.address, type: 'stage_failed' });
    // HTTP: the proxy tells the prefill at once that no decode will read it
    // (before: held to the lease). ZeroMQ: a dead peer says nothing, the
    // decode stage times out after the 1 s lease, which freed them first.
    await expect.poll(() => p.freeBlocks, { timeout: 5000 }).toBe(512);
    if (transport === 'http') expect(p.stats).toMatchObject({ abortedHolds: 1, freedByLease: 0 });
    else expect(p.stats.abortedHolds + p.stats.freedByLease).toBe(1);
  }, 30_000);
});

describe('worker choice and health', () => {
  it('round-robin and least-outstanding pick healthy workers; avoid is a preference', () => {
    const rr = new WorkerPool('prefill', ['a', 'b', 'c']);
    expect([rr.pick(), rr.pick(), rr.pick(), rr.pick()].map((w) => w!.address)).toEqual(['a', 'b', 'c', 'a']);
    rr.markFailed(rr.workers[1]);
    expect([rr.pick(), rr.pick(), rr.pick()].map((w) => w!.address)).toEqual(['a', 'c', 'a']);
    expect(rr.pick(new Set([rr.workers[0], rr.workers[2]]))!.address).toMatch(/[ac]/); // nothing else healthy
    const lo = new WorkerPool('decode', ['a', 'b'], 'least-outstanding');
    lo.workers[0].outstanding = 3;
    expect(lo.pick()!.address).toBe('b');
    rr.markFailed(rr.workers[0]);
    rr.markFailed(rr.workers[2]);
    expect(rr.pick()).toBeUndefined();
  });

  it('a failing health check takes a worker out; a passing one brings it back', async () => {
    let up = true;
    const fake = http.createServer((_q, s) => {
      s.writeHead(up ? 200 : 500).end('{}');
    });
    await new Promise<void>((r) => fake.listen(0, '127.0.0.1', () => r()));
    cleanup.push(() => new Promise((r) => fake.close(r)));
    const url = `http://127.0.0.1:${(fake.address() as AddressInfo).port}`;
    const proxy = await startProxy({ prefill: [url], decode: [url], healthIntervalMs: 0 });
    cleanup.push(() => proxy.close());
    await proxy.checkHealth();
    expect((await fetch(`${proxy.url}/health`)).status).toBe(200);
    up = false;
    await proxy.checkHealth();
    expect(proxy.pools.prefill.workers[0].healthy).toBe(false);
    const h = await fetch(`${proxy.url}/health`);
    expect(h.status).toBe(503);
    const r = await fetch(`${proxy.url}/v1/completions`, { method: 'POST', body: JSON.stringify({ prompt: 'x' }) });
    expect(r.status).toBe(503);
    expect((await r.json()).error).toMatchObject({
      stage: 'prefill',
      message: expect.stringMatching(/no healthy prefill worker/),
    });
    up = true;
    await proxy.checkHealth();
    expect(proxy.pools.prefill.workers[0].healthy).toBe(true);
  });

  it('garbage on a ZeroMQ worker socket does not stop it', async () => {
    const w: Worker = await startWorker({ name: 'zmq-garbage', transport: 'zmq' });
    cleanup.push(() => w.close());
    const push = new zmq.Push({ linger: 0 });
    push.connect(w.address);
    for (const junk of [
      [Buffer.from('x')],
      [Buffer.from('GENERATION'), Buffer.from([0xc1])],
      [Buffer.from('NOPE'), Buffer.from([0x80])],
      // A RELEASE whose id is not a string (once ended the worker's receive loop).
      encodeMessage('RELEASE', { msg_id: 'r', remote_request_id: 42 as unknown as string }),
    ])
      await push.send(junk);
    push.close();
    const proxy = await startProxy({
      transport: 'zmq',
      prefill: [w.address],
      decode: [w.address],
      healthIntervalMs: 0,
    });
    cleanup.push(() => proxy.close());
    await proxy.checkHealth();
    expect(proxy.pools.prefill.workers[0].healthy).toBe(true);
  });
});

describe('one worker in both pools', () => {
  it('decodes in place what it prefilled, and refuses forged kv_transfer_params', async () => {
    const w = await startWorker({ name: 'both', transport: 'http' });
    cleanup.push(() => w.close());
    const proxy = await startProxy({ prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });
    cleanup.push(() => proxy.close());
    const r = await complete(proxy, 3, { stream: true });
    expect(r.got).toBe(r.want);
    expect(w.stats).toMatchObject({ prefills: 1, decodes: 1, freedByRead: 1 });
    expect(w.freeBlocks).toBe(512);
    // Straight to the worker: a decode naming this engine but blocks it does not hold.
    const forged = await fetch(`${w.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        prompt: 'x',
        kv_transfer_params: {
          remote_block_ids: [[0]],
          remote_engine_id: 'both',
          remote_request_id: 'nope',
          remote_host: '127.0.0.1',
          remote_port: 1,
        },
      }),
    });
    expect(forged.status).toBe(400);
    expect((await forged.json()).error.message).toMatch(/holds no such blocks/);
  });
});
