// Bidirectional KV when the client hangs up: a decode holds each answered
// turn for the next one (--decoder-kv-ttl, 480 s), but a turn whose client
// left is never read by anyone, so its blocks come back at once (within a
// second or two here, polled), wherever the cut falls: before the decode's
// first byte, mid-stream, or after the decode wrote its last chunk (the
// params) but before the proxy read it; over HTTP and ZeroMQ, streamed or
// not, with and without a conversation_id.
import * as http from 'node:http';
import * as net from 'node:net';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { decodeMessage, encodeMessage } from '../../lib/serving/api/zmq-protocol';
import type { ServingProxy } from '../../lib/serving/proxy/proxy';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

const PROMPT = 'user: a turn that its client will not wait for, told in many words\n';

/**
 * A TCP relay in front of an HTTP worker: the worker's answer passes until
 * its bytes carry kv_transfer_params (the last chunk, or the whole JSON);
 * from then on they are kept back, as if the proxy had not read them yet.
 */
async function holdBackRelay(target: string): Promise<{ url: string; heldBack: () => boolean }> {
  const { port, hostname } = new URL(target);
  let held = false;
  const socks = new Set<net.Socket>();
  const server = net.createServer((from) => {
    const to = net.connect(Number(port), hostname);
    socks.add(from).add(to);
    let holding = false;
    from.on('data', (d) => to.write(d));
    to.on('data', (d) => {
      if (!holding && d.includes('kv_transfer_params')) holding = held = true;
      if (!holding) from.write(d);
    });
    const end = () => {
      from.destroy();
      to.destroy();
    };
    from.on('close', end).on('error', end);
    to.on('close', end).on('error', end);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  closers.push(async () => {
    for (const s of socks) s.destroy();
    await new Promise((r) => server.close(r));
  });
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, heldBack: () => held };
}

/** The same between a proxy and a ZeroMQ worker: requests pass (reply_to made the relay's), replies are kept back. */
async function holdBackZmqRelay(target: string): Promise<{ url: string; heldBack: () => boolean }> {
  let held = false;
  const inbound = new zmq.Pull({ linger: 0 });
  const toWorker = new zmq.Push({ linger: 0 });
  const replies = new zmq.Pull({ linger: 0 });
  const toProxy = new Map<string, zmq.Push>();
  await inbound.bind('tcp://127.0.0.1:*');
  await replies.bind('tcp://127.0.0.1:*');
  toWorker.connect(target);
  const back = new Map<string, string>();
  void (async () => {
    for await (const frames of inbound) {
      const { tag, body } = decodeMessage(frames);
      if (typeof body.reply_to === 'string') {
        back.set(body.msg_id as string, body.reply_to);
        body.reply_to = replies.lastEndpoint!;
      }
      await toWorker.send(encodeMessage(tag, body as never));
    }
  })().catch(() => {});
  void (async () => {
    let holding = false;
    for await (const frames of replies) {
      const { body } = decodeMessage(frames);
      if (!holding && JSON.stringify(body).includes('kv_transfer_params')) holding = held = true;
      const to = back.get(body.msg_id as string);
      if (holding || !to) continue;
      let s = toProxy.get(to);
      if (!s) {
        s = new zmq.Push({ linger: 0 });
        s.connect(to);
        toProxy.set(to, s);
      }
      await s.send(frames);
    }
  })().catch(() => {});
  closers.push(() => {
    for (const s of [inbound, toWorker, replies, ...toProxy.values()]) s.close();
  });
  return { url: inbound.lastEndpoint!, heldBack: () => held };
}

async function trio(transport: 'http' | 'zmq', relay: boolean) {
  const o = { transport, bidirectionalKv: true, blocks: 128 } as const;
  const prefill = await startWorker({ name: `CP-${Math.random()}`, ...o });
  // The decode waits a little before its pull: time to cut before its first byte.
  const decode = await startWorker({ name: `CD-${Math.random()}`, ...o, testHooks: { stallDecodeMs: 150 } });
  const r = !relay
    ? undefined
    : transport === 'http'
      ? await holdBackRelay(decode.address)
      : await holdBackZmqRelay(decode.address);
  const proxy = await startProxy({
    transport,
    prefill: [prefill.address],
    decode: [r?.url ?? decode.address],
    healthIntervalMs: 0,
  });
  closers.push(
    () => prefill.close(),
    () => decode.close(),
    () => proxy.close(),
  );
  return { prefill, decode, proxy, heldBack: r?.heldBack };
}

/** Polls until `ok`, or fails after `ms`. */
async function until(ok: () => boolean, ms: number, what: string): Promise<void> {
  const t0 = performance.now();
  while (!ok()) {
    if (performance.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 2));
  }
}

type Point = 'before-first-byte' | 'mid-stream' | 'after-last-chunk';

/** Sends one request through the proxy and hangs up at `point`. */
async function cut(
  t: Awaited<ReturnType<typeof trio>>,
  o: { stream: boolean; conversation: boolean; point: Point; maxTokens: number },
): Promise<void> {
  const body = JSON.stringify({
    prompt: PROMPT,
    max_tokens: o.maxTokens,
    stream: o.stream,
    ...(o.conversation ? { conversation_id: `conv-${Math.random()}` } : {}),
  });
  const { port } = new URL(t.proxy.url);
  const decodeRef = t.proxy.pools.decode.workers[0];
  await new Promise<void>((resolve, reject) => {
    const req = http.request(
      {
        host: '127.0.0.1',
        port,
        path: '/v1/completions',
        method: 'POST',
        headers: { 'content-type': 'application/json' },
      },
      (res) => {
        res.once('data', () => {
          if (o.point === 'mid-stream') req.destroy();
        });
        res.on('error', () => {});
        res.on('end', () => reject(new Error(`the answer ended before the cut (${o.point})`)));
      },
    );
    req.on('error', () => {});
    req.on('close', () => resolve());
    req.end(body);
    const when =
      o.point === 'before-first-byte'
        ? // The decode stage is in flight (the decode is stalled before its pull).
          () => decodeRef.outstanding > 0
        : o.point === 'after-last-chunk'
          ? // The decode answered and holds the turn; the proxy has not read the params (the relay keeps
            // them back).
            () => (t.decode.turns?.held ?? 0) > 0 && (t.heldBack?.() ?? true)
          : undefined;
    if (when)
      until(when, 10_000, o.point).then(
        () => req.destroy(),
        (e) => {
          req.destroy();
          reject(e);
        },
      );
  });
}

function free(w: Worker) {
  return w.freeBlocks;
}

async function blocksBack(t: { prefill: Worker; decode: Worker; proxy: ServingProxy }, p0: number, d0: number) {
  // The hold lasts 480 s and the prefill's lease 30 s: back within a few seconds means released.
  await until(() => free(t.decode) === d0 && free(t.prefill) === p0, 3000, 'the blocks to come back').catch((e) => {
    throw new Error(
      `${(e as Error).message}: decode ${free(t.decode)}/${d0} free (turns held ${t.decode.turns?.held}), prefill ${free(t.prefill)}/${p0}`,
    );
  });
  expect(t.proxy.conversations.size).toBe(0);
}

const CASES: Array<{ stream: boolean; point: Point }> = [
  { stream: true, point: 'before-first-byte' },
  { stream: true, point: 'mid-stream' },
  { stream: true, point: 'after-last-chunk' },
  { stream: false, point: 'before-first-byte' },
  { stream: false, point: 'after-last-chunk' },
];

describe.each(['http', 'zmq'] as const)('a turn cut by its client frees the decode hold (%s)', (transport) => {
  for (const { stream, point } of CASES)
    for (const conversation of [false, true])
      it(`${stream ? 'streamed' : 'not streamed'}, cut ${point}, ${conversation ? 'with' : 'without'} a conversation_id`, async () => {
        const t = await trio(transport, point === 'after-last-chunk');
        const d0 = free(t.decode);
        const p0 = free(t.prefill);
        // Mid-stream: an answer long enough to be cut while it streams.
        await cut(t, { stream, conversation, point, maxTokens: point === 'mid-stream' ? 2000 : 24 });
        await blocksBack(t, p0, d0);
        if (point === 'after-last-chunk') expect(t.decode.stats.decodes).toBe(1);
      }, 30_000);
});

describe("the decode's own side of a turn's hold", () => {
  /** A prefilled request's decode body (the prefill's params). */
  async function prefilled(p: Worker, stream: boolean) {
    const pre = await fetch(`${p.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ prompt: PROMPT, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } }),
    }).then((r) => r.json());
    return { prompt: PROMPT, max_tokens: 8, stream, kv_transfer_params: pre.kv_transfer_params };
  }

  it('a hold is freed when its client goes before the answer was written, by request id, or never made', async () => {
    const o = { bidirectionalKv: true, blocks: 128 };
    const p = await startWorker({ name: `OP-${Math.random()}`, ...o });
    const d = await startWorker({ name: `OD-${Math.random()}`, ...o });
    closers.push(
      () => p.close(),
      () => d.close(),
    );
    const d0 = free(d);
    const sink = { chunk() {}, end() {} };
    // The front aborts the request's signal when its connection closes before the last chunk was written out.
    const ac = new AbortController();
    await d.handle({
      path: '/v1/completions',
      body: await prefilled(p, true),
      requestId: 'own-1',
      signal: ac.signal,
      sink,
    });
    expect(d.turns!.held).toBe(1);
    ac.abort();
    await until(() => free(d) === d0, 3000, 'the hold freed on its abort');
    // The proxy's release by its request id (it never got the params).
    await d.handle({
      path: '/v1/completions',
      body: await prefilled(p, false),
      requestId: 'own-2',
      signal: new AbortController().signal,
      sink,
    });
    expect(d.turns!.held).toBe(1);
    expect(d.releaseRequest('own-2')).toBe(1);
    await until(() => free(d) === d0, 3000, 'the hold freed by request id');
    // A release that came before the decode ended: no hold is made.
    expect(d.releaseRequest('own-3')).toBe(0);
    await d.handle({
      path: '/v1/completions',
      body: await prefilled(p, false),
      requestId: 'own-3',
      signal: new AbortController().signal,
      sink,
    });
    expect(d.turns!.held).toBe(0);
    expect(free(d)).toBe(d0);
    // Any other request still holds its turn.
    await d.handle({
      path: '/v1/completions',
      body: await prefilled(p, false),
      requestId: 'own-4',
      signal: new AbortController().signal,
      sink,
    });
    expect(d.turns!.held).toBe(1);
  }, 30_000);
});
