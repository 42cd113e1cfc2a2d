// The HTTP fronts of the proxy and the workers under attack (issue 44):
// clients that send a byte a second, bodies of 100 MB, thousands of
// connections at once, streams cut at every point. Each front cuts or refuses
// what it must, quickly, and afterwards answers a normal request as before
// with every KV block free.
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import { afterEach, describe, expect, it } from 'vitest';
import { DEFAULT_MAX_CONNECTIONS } from '../../lib/serving/api/http-server';
import { serveTrio } from '../helpers';
import { cut as cutAnswer, cutPoints, raw as rawConnection } from './http-cuts';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

const BLOCKS = 128;
const TIMEOUT_MS = 2000;

async function trio(o: { maxConnections?: number } = {}, transport: 'http' | 'zmq' = 'http') {
  const t = await serveTrio(closers, {
    transport,
    prefill: { blocks: BLOCKS, requestTimeoutMs: TIMEOUT_MS },
    decode: { blocks: BLOCKS, requestTimeoutMs: TIMEOUT_MS },
    proxy: { requestTimeoutMs: TIMEOUT_MS, ...o },
  });
  const fronts: Array<readonly [string, string]> = [['proxy', t.proxy.url]];
  if (transport === 'http') fronts.push(['worker', t.decode.address]);
  const normal = async (url: string) => {
    const r = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: 'the lazy dog', max_tokens: 6, temperature: 0 }),
    });
    expect(r.status).toBe(200);
    return ((await r.json()) as { choices: Array<{ text: string }> }).choices[0].text;
  };
  const allFree = async () => {
    await expect.poll(() => t.prefill.freeBlocks, { timeout: 5000 }).toBe(BLOCKS);
    await expect.poll(() => t.decode.freeBlocks, { timeout: 5000 }).toBe(BLOCKS);
  };
  return { ...t, fronts, normal, allFree };
}

const raw = (url: string) => rawConnection(url, closers);

describe('slow clients (a byte a second)', () => {
  it('headers or a body that trickle in are cut after requestTimeout, by the proxy and by a worker', async () => {
    const { fronts, normal, allFree } = await trio();
    const before = await normal(fronts[0][1]);
    const body = JSON.stringify({ prompt: 'x', max_tokens: 2 });
    for (const [name, url] of fronts) {
      // Headers a byte a second; a body a byte a second after whole headers; nothing at all.
      const heads = raw(url);
      const head = `POST /v1/completions HTTP/1.1\r\nHost: ${heads.host}\r\nContent-Type: application/json\r\n`;
      const bodies = raw(url);
      bodies.s.write(
        `POST /v1/completions HTTP/1.1\r\nHost: ${bodies.host}\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n`,
      );
      const idle = raw(url);
      let i = 0;
      const drip = setInterval(() => {
        if (!heads.s.destroyed) heads.s.write(head[i % head.length]);
        if (!bodies.s.destroyed) bodies.s.write(body[i % body.length]);
        i++;
      }, 1000);
      closers.push(() => clearInterval(drip));
      const cuts = await Promise.all([heads.closed, bodies.closed, idle.closed]);
      clearInterval(drip);
      console.log(
        `${name}: cut after ${cuts.map((c) => Math.round(c.ms)).join(' / ')} ms`,
        JSON.stringify(cuts[1].text.slice(0, 40)),
      );
      for (const c of cuts) expect(c.ms, `${name} ${c.text.slice(0, 40)}`).toBeLessThan(TIMEOUT_MS + 4000);
      // The body that trickled is told so (408), never answered as a request.
      expect(cuts[1].text).toMatch(/^(HTTP\/1\.1 408|$)/);
    }
    expect(await normal(fronts[0][1])).toBe(before);
    await allFree();
  }, 60_000);
});

describe('bodies of 100 MB', () => {
  const BIG = 100 << 20;

  /** Sends up to BIG bytes as fast as the server takes them; the status line, when it came, and bytes sent. */
  async function flood(url: string, chunked: boolean) {
    const c = raw(url);
    c.s.write(
      `POST /v1/completions HTTP/1.1\r\nHost: ${c.host}\r\nContent-Type: application/json\r\n` +
        (chunked ? 'Transfer-Encoding: chunked\r\n\r\n' : `Content-Length: ${BIG}\r\n\r\n`),
    );
    const piece = Buffer.alloc(1 << 20, 0x20);
    let sent = 0;
    let statusMs: number | undefined;
    const t0 = performance.now();
    c.s.on('data', () => {
      statusMs ??= performance.now() - t0;
    });
    while (sent < BIG && !c.s.destroyed && statusMs === undefined) {
      const frame = chunked
        ? Buffer.concat([Buffer.from(`${piece.length.toString(16)}\r\n`), piece, Buffer.from('\r\n')])
        : piece;
      const ok = c.s.write(frame);
      sent += piece.length;
      if (!ok)
        await new Promise<void>((r) => {
          const t = setTimeout(r, 200);
          c.s.once('drain', () => {
            clearTimeout(t);
            r();
          });
        });
    }
    const end = await Promise.race([c.closed, new Promise<undefined>((r) => setTimeout(r, 5000))]);
    c.s.destroy();
    const text = end?.text ?? Buffer.concat(c.got).toString('latin1');
    return {
      status: Number(/^HTTP\/1\.1 (\d{3})/.exec(text)?.[1] ?? 0),
      statusMs,
      sentMiB: sent / 2 ** 20,
      closed: !!end,
    };
  }

  it('413 at once, the connection closed, not read to the end (declared and chunked), proxy and worker', async () => {
    const { fronts, normal, allFree } = await trio();
    const before = await normal(fronts[0][1]);
    for (const [name, url] of fronts)
      for (const chunked of [false, true]) {
        const r = await flood(url, chunked);
        console.log(`${name} ${chunked ? 'chunked' : 'declared'}: ${JSON.stringify(r)}`);
        expect(r.status, `${name} chunked=${chunked}`).toBe(413);
        expect(r.closed).toBe(true);
        expect(r.sentMiB).toBeLessThan(50);
      }
    expect(await normal(fronts[0][1])).toBe(before);
    await allFree();
  }, 60_000);
});

describe('many connections at once', () => {
  const fds = () => fs.readdirSync('/proc/self/fd').length;

  it('10,000 connections opened from another process: the proxy holds at most its maxConnections (1000), a worker 4096, then both serve', async () => {
    const CAP = 1000;
    const { fronts, normal, allFree } = await trio({ maxConnections: CAP });
    const before = await normal(fronts[0][1]);
    const fd0 = fds();
    for (const [name, url] of fronts) {
      const cap = name === 'proxy' ? CAP : DEFAULT_MAX_CONNECTIONS;
      const u = new URL(url);
      // The connections live in a child process, so this one holds only the server's side.
      const script = `
        const net = require('node:net');
        const N = ${10_000}; let open = 0, refused = 0, closed = 0; const socks = [];
        for (let i = 0; i < N; i++) {
          const s = net.connect(${u.port}, '${u.hostname}');
          s.on('connect', () => { open++; });
          s.on('error', () => { refused++; });
          s.on('close', () => { closed++; });
          socks.push(s);
        }
        const t = setInterval(() => {
          if (open + refused >= N) { clearInterval(t); setTimeout(() => {
            console.log(JSON.stringify({ open, refused, closed }));
            for (const s of socks) s.destroy(); process.exit(0); }, 1500); }
        }, 50);
        setTimeout(() => { console.log(JSON.stringify({ open, refused, closed, timeout: true })); process.exit(0); }, 30000);`;
      const child = spawn(process.execPath, ['-e', script], { stdio: ['ignore', 'pipe', 'inherit'] });
      closers.push(() => child.kill('SIGKILL'));
      let out = '';
      child.stdout.on('data', (d) => (out += d));
      let peak = 0;
      const sample = setInterval(() => (peak = Math.max(peak, fds() - fd0)), 20);
      await new Promise((r) => child.on('exit', r));
      clearInterval(sample);
      console.log(`${name}: ${out.trim()}, server-side descriptors at most +${peak}`);
      const r = JSON.parse(out) as { open: number; refused: number; closed: number };
      expect(r.open + r.refused).toBe(10_000);
      expect(peak).toBeLessThan(cap + 200);
      expect(await normal(url)).toBe(before);
    }
    await allFree();
  }, 120_000);
});

describe.each(['http', 'zmq'] as const)('streams cut at every point (workers over %s)', (transport) => {
  it('cut mid-request, before the first byte, at 16 points of the answer and after the last chunk: every block free, the next answer right', async () => {
    const { fronts, normal, allFree, proxy } = await trio({}, transport);
    const before = await normal(fronts[0][1]);
    const body = JSON.stringify({
      prompt: `cut me: ${'the quick brown fox jumps over the lazy dog '.repeat(6)}`,
      max_tokens: 24,
      temperature: 0,
      stream: true,
    });
    const request = (host: string) =>
      `POST /v1/completions HTTP/1.1\r\nHost: ${host}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
    const cut = (url: string, sendBytes: number | undefined, cutAt: number | 'end' | 'never') =>
      cutAnswer(closers, url, '/v1/completions', body, sendBytes, cutAt);
    for (const [name, url] of fronts) {
      // The whole answer, for its length.
      const whole = await cut(url, undefined, 'end');
      expect(whole.text).toMatch(/^HTTP\/1\.1 200/);
      expect(whole.text).toContain('data: [DONE]');
      const L = whole.text.length;
      const points = cutPoints(L, 16);
      await cut(url, 40, 'never');
      await cut(url, Buffer.byteLength(request('x')) - 10, 'never');
      for (const p of points) await cut(url, undefined, p);
      await cut(url, undefined, 'end');
      await allFree();
      console.log(`${name}: ${L} bytes answered, cut at ${points.join(', ')} and after the end`);
      expect(await normal(url)).toBe(before);
    }
    expect(proxy.stats.requests).toBe(proxy.stats.completed + proxy.stats.failed + proxy.stats.aborted);
  }, 60_000);
});
