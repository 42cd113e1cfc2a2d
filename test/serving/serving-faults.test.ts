// Serving that survives its workers and its clients (issue 24): ids that
// cannot change the protocol, signed kv_transfer_params, 4xx for every client
// mistake (never counted against a worker), bodies that trickle in are cut,
// prefill holds released when their decode will not read them, no prefill
// while no decode is healthy, and a fault-injection run under load that
// counts right answers, typed errors and wrong answers (which must be 0).
import type { ChildProcess } from 'node:child_process';
import * as net from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { start } from '../../dist/demo/serving';
import { startProxy, startWorker } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import { signKvTransferParams } from '../../lib/kv/params-auth';
import { freePort, serveTrio } from '../helpers';

const closers: Array<() => unknown> = [];
const procs: ChildProcess[] = [];
afterEach(async () => {
  for (const p of procs.splice(0)) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
  for (const c of closers.splice(0).reverse()) await c();
});
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function post(url: string, body: unknown, headers: Record<string, string> = {}) {
  const r = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await r.text();
  let json: Record<string, unknown> = {};
  try {
    json = JSON.parse(text);
  } catch {
    /* not JSON */
  }
  return { status: r.status, json, headers: r.headers };
}

const prompt = (i: number) => `fault ${i}: ${'the lazy dog '.repeat(1 + (i % 5))}`;
const right = (j: Record<string, unknown>, i: number) =>
  (j.choices as Array<{ text: string }> | undefined)?.[0]?.text === expectedCompletion(prompt(i), 6).join(' ');

function deployment(o: { transport?: 'http' | 'zmq'; secret?: string; leaseMs?: number } = {}) {
  return serveTrio(closers, {
    transport: o.transport,
    prefill: { blocks: 64, leaseMs: o.leaseMs, kvSecret: o.secret },
    decode: { blocks: 256, kvSecret: o.secret },
    proxy: { requestTimeoutMs: 1000 },
  });
}

describe('request ids cannot change the protocol', () => {
  it("X-Request-Id 'HB:probe-1' is a label: the prefill frees the blocks on the read, not at the lease", async () => {
    const { prefill, proxy } = await deployment();
    for (const id of ['HB:probe-1', 'a,b', 'x:1']) {
      const r = await post(`${proxy.url}/v1/completions`, { prompt: prompt(1), max_tokens: 6 }, { 'x-request-id': id });
      expect(r.status).toBe(200);
      expect(right(r.json, 1)).toBe(true);
      expect(r.headers.get('x-request-id')).toBe(id);
    }
    await expect.poll(() => prefill.stats.freedByRead, { timeout: 3000 }).toBe(3);
    expect(prefill.freeBlocks).toBe(64);
  });
});

describe('kv_transfer_params sent straight to a decode', () => {
  async function prefillOnce(url: string) {
    const r = await post(`${url}/v1/completions`, {
      prompt: prompt(2),
      max_tokens: 1,
      kv_transfer_params: { do_remote_decode: true },
    });
    expect(r.status).toBe(200);
    return r.json.kv_transfer_params as Record<string, unknown>;
  }

  it('with a shared secret: unsigned, forged or re-pointed params are refused (400), nothing is read', async () => {
    const { prefill, decode } = await deployment({ secret: 's3cret' });
    const kv = await prefillOnce(prefill.address);
    expect(typeof kv.nixl_node_signature).toBe('string');
    const { nixl_node_signature: _sig, ...unsigned } = kv;
    const cases: Array<[string, Record<string, unknown>]> = [
      ['unsigned', unsigned],
      ['another request id', { ...kv, remote_request_id: 'kv-someone-else' }],
      ['other blocks', { ...kv, remote_block_ids: [[0, 1]] }],
      ['tp_size 3', { ...kv, tp_size: 3 }],
      ['signed with another secret', signKvTransferParams(unsigned, 'guess')],
    ];
    for (const [what, params] of cases) {
      const r = await post(`${decode.address}/v1/completions`, {
        prompt: prompt(2),
        max_tokens: 6,
        kv_transfer_params: params,
      });
      expect(r.status, what).toBe(400);
      expect(String((r.json.error as { message: string }).message), what).toMatch(/signature|not signed/);
    }
    expect(decode.stats.decodes).toBe(0);
    expect(decode.stats.verifiedBytes).toBe(0);
    const ok = await post(`${decode.address}/v1/completions`, {
      prompt: prompt(2),
      max_tokens: 6,
      kv_transfer_params: kv,
    });
    expect(ok.status).toBe(200);
    expect(decode.stats.decodes).toBe(1);
  });

  it('without a secret (vLLM-compatible): tp_size 3 or 2048 against a warm connection is a 400, and the next pull works', async () => {
    const { prefill, decode } = await deployment();
    const warm = await prefillOnce(prefill.address);
    expect(
      (await post(`${decode.address}/v1/completions`, { prompt: prompt(2), max_tokens: 6, kv_transfer_params: warm }))
        .status,
    ).toBe(200);
    for (const tp of [3, 2048]) {
      const kv = await prefillOnce(prefill.address);
      const r = await post(`${decode.address}/v1/completions`, {
        prompt: prompt(2),
        max_tokens: 6,
        kv_transfer_params: { ...kv, tp_size: tp },
      });
      expect(r.status, JSON.stringify(r.json)).toBe(400);
    }
    const kv = await prefillOnce(prefill.address);
    expect(
      (await post(`${decode.address}/v1/completions`, { prompt: prompt(2), max_tokens: 6, kv_transfer_params: kv }))
        .status,
    ).toBe(200);
  });
});

describe('every client mistake is a 4xx and never counts against a worker', () => {
  for (const transport of ['http', 'zmq'] as const) {
    it(`null and wrong-typed fields, null kv_transfer_params, a prompt larger than the KV cache (${transport})`, async () => {
      const { proxy, decode } = await deployment({ transport });
      const chat = `${proxy.url}/v1/chat/completions`;
      const cases: Array<[string, unknown, number]> = [
        [chat, { messages: [{ role: 'user', content: null }] }, 400],
        [chat, { messages: [{ role: 'user', content: [null] }] }, 400],
        [chat, { messages: [{ role: 'user', content: [{ type: 'text', text: 7 }] }] }, 400],
        [chat, { messages: [null] }, 400],
        [chat, { messages: [{ role: 'user', content: 'hi' }], temperature: 'hot' }, 400],
        [`${proxy.url}/v1/completions`, { prompt: 'x', stop: [1] }, 400],
        [`${proxy.url}/v1/completions`, { prompt: 'x', max_tokens: 0 }, 400],
        [`${proxy.url}/v1/completions`, { prompt: 'y'.repeat(64 * 16 + 1), max_tokens: 1 }, 400],
      ];
      for (const [url, body, status] of cases) {
        const r = await post(url, body);
        expect(r.status, JSON.stringify(body).slice(0, 100)).toBe(status);
        // The very next valid request is served: no worker was taken out.
        const ok = await post(`${proxy.url}/v1/completions`, { prompt: prompt(3), max_tokens: 6 });
        expect(ok.status, JSON.stringify(ok.json)).toBe(200);
      }
      expect(proxy.pools.prefill.workers.every((w) => w.healthy)).toBe(true);
      if (transport === 'http') {
        const r = await post(`${decode.address}/v1/completions`, { prompt: 'x', kv_transfer_params: null });
        expect(r.status).toBe(400);
        expect(String((r.json.error as { message: string }).message)).toMatch(/kv_transfer_params/);
      }
    });
  }

  it('a body that trickles in is cut after the request timeout', async () => {
    const { proxy } = await deployment();
    const port = Number(new URL(proxy.url).port);
    const t0 = performance.now();
    const closedAfter = await new Promise<number>((resolve) => {
      const s = net.connect(port, '127.0.0.1', () => {
        s.write(
          'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{',
        );
        const t = setInterval(() => s.writable && s.write(' '), 100);
        s.on('close', () => {
          clearInterval(t);
          resolve(performance.now() - t0);
        });
      });
      s.on('error', () => {});
      s.resume();
    });
    // requestTimeoutMs 1000, checked every second.
    expect(closedAfter).toBeLessThan(3500);
  });
});

describe('prefill holds released when their decode will not read them', () => {
  it('a client that goes away during the prefill or the pull frees the blocks at once, not at the lease', async () => {
    const prefill = await startWorker({ blocks: 64, testHooks: { stallPrefillMs: 300 } });
    const decode = await startWorker({ blocks: 256, testHooks: { stallDecodeMs: 300 } });
    const proxy = await startProxy({ prefill: [prefill.address], decode: [decode.address], healthIntervalMs: 0 });
    closers.push(
      () => prefill.close(),
      () => decode.close(),
      () => proxy.close(),
    );
    for (const cutAt of [100, 450]) {
      const ac = new AbortController();
      const req = fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: prompt(4), max_tokens: 6 }),
        signal: ac.signal,
      }).catch(() => undefined);
      await sleep(cutAt);
      ac.abort();
      await req;
      // The default lease is 30 s: blocks back within a second means released.
      await expect.poll(() => prefill.freeBlocks, { timeout: 1500 }).toBe(64);
    }
    expect(prefill.stats.abortedHolds).toBe(2);
    expect(prefill.stats.freedByLease).toBe(0);
  });
});

describe.each(['http', 'zmq'] as const)('killed workers over %s', (transport) => {
  it('decode SIGKILLed: no prefill while no decode is healthy; restarted on its address, right answers within 2 health intervals', async () => {
    const healthMs = 300;
    const port = await freePort();
    const addr = transport === 'http' ? ['--port', String(port)] : ['--zmq-addr', `tcp://127.0.0.1:${port}`];
    const dargs = ['worker', '--name', `dk-${transport}`, '--blocks', '256', '--transport', transport, ...addr];
    const d1 = await start(dargs, (p) => procs.push(p));
    const prefill = await startWorker({ transport, blocks: 64 });
    const proxy = await startProxy({
      transport,
      prefill: [prefill.address],
      decode: [String(d1.ready.address)],
      healthIntervalMs: healthMs,
      timeoutMs: { prefill: 2000, decode: 2000 },
    });
    closers.push(
      () => prefill.close(),
      () => proxy.close(),
    );
    expect(right((await post(`${proxy.url}/v1/completions`, { prompt: prompt(5), max_tokens: 6 })).json, 5)).toBe(true);
    // Idle first: the decode's completion notification has reached the prefill (on NIXL it
    // goes out asynchronously, and a process killed right after may never send it).
    await expect.poll(() => prefill.stats.freedByRead, { timeout: 3000 }).toBe(1);
    d1.p.kill('SIGKILL');
    await new Promise((r) => d1.p.once('exit', r));
    // Requests while it is down: errors, and the prefill's cache stays free.
    const down = await Promise.all(
      Array.from({ length: 8 }, (_, i) => post(`${proxy.url}/v1/completions`, { prompt: prompt(i), max_tokens: 6 })),
    );
    expect(down.every((r) => r.status >= 500 && r.json.error)).toBe(true);
    await expect.poll(() => prefill.freeBlocks, { timeout: 2500 }).toBe(64);
    const prefillsWhileDown = prefill.stats.prefills;
    await sleep(healthMs * 2);
    for (let i = 0; i < 5; i++) await post(`${proxy.url}/v1/completions`, { prompt: prompt(i), max_tokens: 6 });
    expect(prefill.stats.prefills).toBe(prefillsWhileDown); // nothing prefilled for a dead decode
    await start(dargs, (p) => procs.push(p));
    const back = performance.now();
    let firstRight = Number.POSITIVE_INFINITY;
    while (performance.now() - back < 5000) {
      const r = await post(`${proxy.url}/v1/completions`, { prompt: prompt(6), max_tokens: 6 });
      if (right(r.json, 6)) {
        firstRight = performance.now() - back;
        break;
      }
      await sleep(20);
    }
    expect(firstRight).toBeLessThan(2 * healthMs);
  }, 30_000);

  it('fault injection under load: kills and restarts of both roles, 0 wrong answers, every block free within a lease', async () => {
    const leaseMs = 1500;
    const [pport, dport] = [await freePort(), await freePort()];
    const at = (p: number) => (transport === 'http' ? ['--port', String(p)] : ['--zmq-addr', `tcp://127.0.0.1:${p}`]);
    const pargs = [
      'worker',
      '--name',
      `fp-${transport}`,
      '--blocks',
      '96',
      '--lease-ms',
      String(leaseMs),
      '--transport',
      transport,
      ...at(pport),
    ];
    const dargs = ['worker', '--name', `fd-${transport}`, '--blocks', '512', '--transport', transport, ...at(dport)];
    let pre = await start(pargs, (p) => procs.push(p));
    let dec = await start(dargs, (p) => procs.push(p));
    const proxy = await startProxy({
      transport,
      prefill: [String(pre.ready.address)],
      decode: [String(dec.ready.address)],
      healthIntervalMs: 200,
      timeoutMs: { prefill: 2000, decode: 3000 },
    });
    closers.push(() => proxy.close());
    const tally = { right: 0, typed: 0, wrong: [] as string[] };
    let stop = false;
    const client = async (c: number) => {
      for (let i = c; !stop; i += 8) {
        const r = await post(`${proxy.url}/v1/completions`, { prompt: prompt(i), max_tokens: 6 }).catch((e) => ({
          status: 0,
          json: { error: String(e) } as Record<string, unknown>,
        }));
        if (r.status === 200 && right(r.json, i)) tally.right++;
        else if (r.status >= 500 && r.json.error) tally.typed++;
        else tally.wrong.push(`${r.status} ${JSON.stringify(r.json).slice(0, 200)}`);
      }
    };
    const clients = Array.from({ length: 8 }, (_, c) => client(c));
    for (const victim of ['prefill', 'decode', 'prefill', 'decode'] as const) {
      await sleep(700);
      const w = victim === 'prefill' ? pre : dec;
      w.p.kill('SIGKILL');
      await new Promise((r) => w.p.once('exit', r));
      await sleep(300);
      if (victim === 'prefill') pre = await start(pargs, (p) => procs.push(p));
      else dec = await start(dargs, (p) => procs.push(p));
    }
    await sleep(1500);
    stop = true;
    await Promise.all(clients);
    expect(tally.wrong).toEqual([]);
    expect(tally.right).toBeGreaterThan(20);
    // Answers come back after the last restart (a stage that timed out on
    // the killed incarnation may take the worker out until the next check).
    await expect
      .poll(
        async () => right((await post(`${proxy.url}/v1/completions`, { prompt: prompt(1), max_tokens: 6 })).json, 1),
        {
          timeout: 2000,
          interval: 100,
        },
      )
      .toBe(true);
    // Every block of the live prefill is free within one lease of the end.
    await expect
      .poll(
        () => {
          pre.p.kill('SIGUSR2');
          return pre.lines.filter((l) => l.stats).at(-1)?.freeBlocks;
        },
        { timeout: leaseMs + 1000, interval: 100 },
      )
      .toBe(96);
    console.log(`fault injection (${transport}): ${tally.right} right, ${tally.typed} typed errors, 0 wrong`);
  }, 60_000);
});
