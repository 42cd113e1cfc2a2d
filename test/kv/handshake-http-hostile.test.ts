// The HTTP side channel's fetch against hostile peers on 127.0.0.1: every
// misbehaviour (silence after the headers, a trickled body, a huge chunk, an
// answer at and over maxResponseBytes, a reset mid-body, aborts at every
// point) settles with a code, and the next fetch on the same kept-alive agent
// answers: never a hang, a crash, or a listener left on the caller's signal.
import * as http from 'node:http';
import * as net from 'node:net';
import { getEventListeners } from 'node:events';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { HttpHandshake, createHandshake } from '../../lib/handshake';
import { rankZeroPayload, within } from './handshake-helpers';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** What the peer does with one request on one connection. */
type Behaviour = (s: net.Socket) => void;

let body = ''; // a valid answer's body, taken from a real side channel
let port = 0;
let server: net.Server;
let behave: Behaviour = () => {};
let requests = 0;
const sockets = new Set<net.Socket>();
const timers = new Set<NodeJS.Timeout>();

const head = (extra: string) =>
  `HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n${extra}\r\n`;
const ok: Behaviour = (s) => s.write(`${head(`Content-Length: ${Buffer.byteLength(body)}\r\n`)}${body}`);
/** Writes `bytes` one byte every `ms`, until the socket goes. */
function trickle(s: net.Socket, bytes: string, ms: number): void {
  let i = 0;
  const t = setInterval(() => {
    if (s.destroyed || i >= bytes.length) return void clearInterval(t);
    s.write(bytes[i++]);
  }, ms);
  timers.add(t);
}

beforeAll(async () => {
  const real = new HttpHandshake();
  const srv = await real.serve({
    port: 0,
    logger: { warn: () => {} },
    payloads: rankZeroPayload(),
  });
  body = await new Promise<string>((resolve, reject) =>
    http
      .get(`http://127.0.0.1:${srv.port}/get_kv_connector_metadata/0/0`, (res) => {
        let t = '';
        res.on('data', (c) => {
          t += c;
        });
        res.on('end', () => resolve(t));
      })
      .on('error', reject),
  );
  real.close();
  await srv.close();
  server = net.createServer((s) => {
    sockets.add(s);
    s.on('close', () => sockets.delete(s));
    s.on('error', () => {});
    let buf = '';
    s.on('data', (c) => {
      buf += c.toString('latin1');
      for (let at = buf.indexOf('\r\n\r\n'); at >= 0; at = buf.indexOf('\r\n\r\n')) {
        buf = buf.slice(at + 4);
        requests++;
        behave(s);
      }
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  port = (server.address() as net.AddressInfo).port;
});

afterEach(() => {
  for (const t of timers) clearInterval(t);
  timers.clear();
});

afterAll(async () => {
  for (const s of sockets) s.destroy();
  await new Promise((r) => server.close(r));
});

const h = new HttpHandshake();
afterAll(() => h.close());
const get = (o: { timeoutMs?: number; maxResponseBytes?: number; signal?: AbortSignal } = {}) =>
  h.fetch({ host: '127.0.0.1', port, tpRank: 0, retries: 0, timeoutMs: 400, ...o });

/** The next fetch, with the peer behaving, answers on the same agent. */
async function nextAnswers(what: string): Promise<void> {
  behave = ok;
  const got = await within(get({ timeoutMs: 5000 }), 8000, `the fetch after ${what}`);
  expect(got.metadata.agentMetadata.toString()).toBe('md');
}

describe('HTTP side channel against a hostile peer', () => {
  it('answers a behaving peer, then again on the kept-alive connection', async () => {
    await nextAnswers('nothing');
    const before = requests;
    await nextAnswers('one answer');
    expect(requests).toBe(before + 1);
  });

  it('headers then silence: NIXL_ERR_TIMEOUT, then the next fetch answers', async () => {
    await nextAnswers('warming the pool'); // so the hostile answer comes on a reused socket
    behave = (s) => s.write(head('Content-Length: 1000\r\n'));
    await expect(within(get(), 8000, 'headers then silence')).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
    await nextAnswers('headers then silence');
  });

  it('a body trickled one byte per 100 ms past timeoutMs: NIXL_ERR_TIMEOUT (the timeout is for the whole answer)', async () => {
    behave = (s) => {
      s.write(head(`Content-Length: ${Buffer.byteLength(body)}\r\n`));
      trickle(s, body, 100);
    };
    await expect(within(get({ timeoutMs: 500 }), 8000, 'a trickled body')).rejects.toMatchObject({
      code: 'NIXL_ERR_TIMEOUT',
    });
    await nextAnswers('a trickled body');
  });

  it('chunked with a huge chunk size: over maxResponseBytes is refused, silence times out', async () => {
    behave = (s) => s.write(`${head('Transfer-Encoding: chunked\r\n')}ffffffffffff\r\n${'x'.repeat(4096)}`);
    await expect(within(get({ maxResponseBytes: 1024 }), 8000, 'a huge chunk')).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
      message: expect.stringMatching(/larger than 1024 bytes/),
    });
    await nextAnswers('a huge chunk over the limit');
    behave = (s) => s.write(`${head('Transfer-Encoding: chunked\r\n')}ffffffffffff\r\nxx`);
    await expect(within(get(), 8000, 'a huge chunk, then silence')).rejects.toMatchObject({
      code: 'NIXL_ERR_TIMEOUT',
    });
    await nextAnswers('a huge chunk then silence');
  });

  it('an answer of exactly maxResponseBytes is taken; one byte over is refused; the agent answers after both', async () => {
    const n = Buffer.byteLength(body);
    await nextAnswers('warming the pool');
    const got = await within(get({ maxResponseBytes: n }), 8000, 'an answer of exactly the limit');
    expect(got.metadata.agentMetadata.toString()).toBe('md');
    await expect(within(get({ maxResponseBytes: n - 1 }), 8000, 'one byte over')).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
    });
    await nextAnswers('one byte over');
    // The same over an answer that arrives in many small pieces.
    behave = (s) => {
      s.write(head(`Content-Length: ${n}\r\n`));
      trickle(s, body, 1);
    };
    await expect(
      within(get({ maxResponseBytes: n - 1, timeoutMs: 10_000 }), 12_000, 'one byte over, trickled'),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
    await nextAnswers('one byte over, trickled');
  });

  it('a reset mid-body: NIXL_ERR_REMOTE_DISCONNECT, then the next fetch answers', async () => {
    await nextAnswers('warming the pool');
    /** Headers and 20 bytes of the body, then `cut`: the fetch fails as a disconnect, the next one answers. */
    const cutMidBody = async (cut: (s: net.Socket) => void, what: string) => {
      behave = (s) => {
        s.write(`${head(`Content-Length: ${Buffer.byteLength(body)}\r\n`)}${body.slice(0, 20)}`);
        setTimeout(() => cut(s), 50);
      };
      // The fetch's own error is 'no answer after N attempts'; its cause says why.
      await expect(within(get({ timeoutMs: 5000 }), 8000, what)).rejects.toMatchObject({
        cause: { code: 'NIXL_ERR_REMOTE_DISCONNECT' },
      });
      await nextAnswers(what);
    };
    await cutMidBody((s) => s.resetAndDestroy(), 'a reset mid-body');
    await cutMidBody((s) => s.end(), 'an end mid-body');
  });

  it('an unasked-for second answer on a kept-alive connection is never taken as the next answer', async () => {
    await nextAnswers('warming the pool');
    const stale = '{"detail":"stale"}';
    for (const gap of [0, 50]) {
      behave = (s) => {
        ok(s);
        const extra = `HTTP/1.1 404 Not Found\r\nContent-Length: ${stale.length}\r\nConnection: keep-alive\r\n\r\n${stale}`;
        if (gap === 0) s.write(extra);
        else setTimeout(() => s.write(extra), gap);
      };
      await within(get({ timeoutMs: 5000 }), 8000, 'an answer and an extra one');
      await sleep(100);
      await nextAnswers(`an extra answer ${gap} ms after the first`);
    }
  });

  it('aborts before the send, during the headers, during the body and after the end', async () => {
    const before = requests;
    await expect(within(get({ signal: AbortSignal.abort() }), 8000, 'aborted before')).rejects.toMatchObject({
      code: 'NIXL_ERR_CANCELED',
    });
    await sleep(50);
    expect(requests).toBe(before); // nothing was sent
    for (const [what, b] of [
      ['during the headers', () => {}],
      ['during the body', (s: net.Socket) => s.write(head('Content-Length: 1000\r\n'))],
    ] as const) {
      behave = b;
      const ac = new AbortController();
      const got = get({ timeoutMs: 10_000, signal: ac.signal });
      await sleep(100);
      ac.abort(new Error('caller gave up'));
      await expect(within(got, 8000, `aborted ${what}`)).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
      await nextAnswers(`an abort ${what}`);
    }
    const ac = new AbortController();
    behave = ok;
    await within(get({ signal: ac.signal }), 8000, 'a fetch aborted after its end');
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    ac.abort(new Error('too late'));
    await sleep(50);
    await nextAnswers('an abort after the end');
  });

  it('many fetches on one long-lived signal leave no listener on it and no timer behind', async () => {
    const ac = new AbortController();
    const timersNow = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
    const t0 = timersNow();
    for (let i = 0; i < 20; i++) {
      behave = i % 4 === 0 ? () => {} : ok;
      await get({
        signal: ac.signal,
        timeoutMs: i % 4 === 0 ? 100 : 60_000,
        maxResponseBytes: i % 4 === 1 ? 10 : undefined,
      }).catch(() => {});
    }
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    // 60 s timers of fetches that answered would still be here if not cleared.
    expect(timersNow()).toBeLessThanOrEqual(t0 + 2);
  });

  it('many concurrent fetches to a silent peer all time out, and the agent then answers', async () => {
    behave = () => {};
    const ac = new AbortController();
    const all = Array.from({ length: 40 }, () => get({ timeoutMs: 300, signal: ac.signal }));
    const settled = await within(Promise.allSettled(all), 15_000, '40 fetches to a silent peer');
    for (const r of settled) expect(r).toMatchObject({ status: 'rejected', reason: { code: 'NIXL_ERR_TIMEOUT' } });
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    await nextAnswers('40 silent fetches');
  });

  it('many concurrent fetches to a silent peer, one signal aborted: all cancelled, no timer or listener left', async () => {
    behave = () => {};
    const timersNow = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
    const t0 = timersNow();
    const ac = new AbortController();
    const all = Array.from({ length: 40 }, () => get({ timeoutMs: 60_000, signal: ac.signal }));
    await sleep(100);
    ac.abort(new Error('caller gave up'));
    const settled = await within(Promise.allSettled(all), 8000, '40 aborted fetches');
    for (const r of settled) expect(r).toMatchObject({ status: 'rejected', reason: { code: 'NIXL_ERR_CANCELED' } });
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    expect(timersNow()).toBeLessThanOrEqual(t0 + 2); // forty 60 s timers would still be here
    await nextAnswers('40 aborted fetches');
  });

  it('a timeoutMs past what a timer holds (2^31 ms) still waits for the answer', async () => {
    behave = (s) => setTimeout(() => ok(s), 150);
    const got = await within(get({ timeoutMs: 2 ** 32 }), 8000, 'a fetch with a 50-day timeout');
    expect(got.metadata.agentMetadata.toString()).toBe('md');
  });

  it.each([0, -1, Number.NaN, Number.POSITIVE_INFINITY])(
    'timeoutMs %s is refused (NIXL_ERR_INVALID_PARAM)',
    async (t) => {
      behave = ok;
      await expect(within(get({ timeoutMs: t }), 8000, `timeoutMs ${t}`)).rejects.toMatchObject({
        code: 'NIXL_ERR_INVALID_PARAM',
        message: expect.stringMatching(/timeoutMs/),
      });
    },
  );

  it.each([Number.NaN, -1, 0, 1.5])('maxResponseBytes %s is refused (NaN was no limit at all)', async (n) => {
    behave = ok;
    await expect(within(get({ maxResponseBytes: n }), 8000, `maxResponseBytes ${n}`)).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
      message: expect.stringMatching(/maxResponseBytes must be/),
    });
  });

  it('a request Node refuses to make (a header with a newline) fails at once, not retried, and nothing fires later', async () => {
    behave = ok;
    const before = requests;
    const got = h.fetch({ host: '127.0.0.1', port, tpRank: 0, retries: 2, timeoutMs: 100, bearerToken: 'a\nb' });
    await expect(within(got, 8000, 'a bad header')).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
      message: expect.stringMatching(/header/i),
    });
    await sleep(400); // past each attempt's timer: one left behind would throw here
    expect(requests).toBe(before);
    await nextAnswers('a bad header');
  });

  it('ZeroMQ refuses the same timeouts (-1 there waited for ever on a silent peer)', async () => {
    behave = () => {};
    const z = createHandshake('zmq');
    try {
      for (const t of [0, -1, Number.NaN])
        await expect(
          within(z.fetch({ host: '127.0.0.1', port, tpRank: 0, retries: 0, timeoutMs: t }), 8000, `zmq timeoutMs ${t}`),
        ).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
      await expect(
        within(z.fetch({ host: '127.0.0.1', port, tpRank: 0, retries: 0, maxResponseBytes: Number.NaN }), 8000, 'zmq'),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
    } finally {
      z.close();
    }
  });
});
