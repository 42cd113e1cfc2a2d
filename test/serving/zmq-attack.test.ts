// The ZeroMQ serving protocol under attack (issue 44): whoever reaches a
// worker's PULL socket sends mutated messages, huge frames, messages from
// many peers, and names reply addresses that read slowly or not at all. A
// message the worker cannot read is dropped and counted; a malformed one with
// a usable reply_to gets a 400 FAILURE with a code; nothing crashes or hangs,
// and afterwards a normal request answers as before with every KV block free.
import * as fs from 'node:fs';
import { Packr } from 'msgpackr';
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import { startWorker } from '../../lib/serving';
import { decodeMessage, encodeMessage, unpackMap } from '../../lib/serving/api/zmq-protocol';
import { ZmqDispatch } from '../../lib/serving/worker/fronts/zmq-dispatch';
import { ZmqFront } from '../../lib/serving/worker/fronts/zmq';
import { ZmqTransport } from '../../lib/serving/proxy/transports/zmq';
import { messages, silentCount } from './zmq-mutations';
import type { ZmqReply } from '../../lib/serving/api/zmq-protocol';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

const packr = new Packr({ useRecords: false, mapsAsObjects: true, variableMapSize: true });
const GOOD_TO = 'tcp://127.0.0.1:5999';
const BLOCKS = 256;

/** A reply that ends a call: a FAILURE, a HEALTH, or the last message of an answer. */
const isFinal = (tag: string, r: ZmqReply) => (tag !== 'ENCODE' && tag !== 'GENERATION' ? true : r.done !== false);

describe('the ZeroMQ serving codec and handler, in process', () => {
  it('10,000 mutated messages (seed 44): no throw, no 5xx, each one answered or dropped and counted; then the same answer, every block free', async () => {
    const w = await startWorker({ transport: 'zmq', blocks: BLOCKS, leaseMs: 300 });
    closers.push(() => w.close());
    const replies: Array<{ to: string; tag: string; r: ZmqReply }> = [];
    const d = new ZmqDispatch(w, (to, tag, r) => replies.push({ to, tag, r }));
    const normal = async (id: string) => {
      const n = replies.length;
      d.onMessage(
        encodeMessage('GENERATION', {
          msg_id: id,
          reply_to: GOOD_TO,
          path: '/v1/completions',
          payload: { prompt: 'the lazy dog', max_tokens: 6, temperature: 0 },
        }),
      );
      await expect
        .poll(() => replies.slice(n).find((x) => x.r.msg_id === id), { timeout: 5000, interval: 5 })
        .toBeTruthy();
      const got = replies.slice(n).find((x) => x.r.msg_id === id)!;
      expect(got.r.status).toBe(200);
      return (got.r.payload as { choices: Array<{ text: string }> }).choices[0].text;
    };
    const before = await normal('before');
    const rejections: unknown[] = [];
    const onRejection = (e: unknown) => rejections.push(e);
    process.on('unhandledRejection', onRejection);
    closers.push(() => process.off('unhandledRejection', onRejection));
    const all = messages(10_000, 44, GOOD_TO);
    const heap0 = process.memoryUsage().heapUsed;
    const t0 = performance.now();
    const dropped0 = w.stats.messagesDropped;
    for (let b = 0; b < all.length; b += 250) {
      for (const m of all.slice(b, b + 250)) expect(() => d.onMessage(m.frames), m.label).not.toThrow();
      await expect.poll(() => d.inFlight, { timeout: 20_000, interval: 5 }).toBe(0);
    }
    const ms = performance.now() - t0;
    const finals = replies.filter((x) => isFinal(x.tag, x.r));
    const dropped = w.stats.messagesDropped - dropped0;
    const byStatus: Record<string, number> = {};
    for (const f of finals)
      byStatus[`${f.tag} ${f.r.status ?? ''}`] = (byStatus[`${f.tag} ${f.r.status ?? ''}`] ?? 0) + 1;
    // ABORT and RELEASE with a msg_id are never answered; every other message is answered once or dropped and counted.
    const silent = silentCount(all);
    console.log(
      `10,000 mutated: ${Math.round(ms)} ms, ${dropped} dropped, ${finals.length - 1} answered, ${silent} ABORT/RELEASE`,
      JSON.stringify(byStatus),
    );
    expect(rejections).toEqual([]);
    // Every FAILURE says why with a code; none is the worker's fault.
    const failures = finals.filter((x) => x.tag === 'FAILURE');
    for (const f of failures) {
      expect(typeof f.r.error?.code, JSON.stringify(f.r)).toBe('string');
      expect(f.r.status, JSON.stringify(f.r).slice(0, 300)).toBeLessThan(500);
    }
    expect(dropped).toBeGreaterThan(500);
    expect(failures.length).toBeGreaterThan(1000);
    expect(dropped + finals.length - 1).toBe(all.length - silent);
    expect({} as Record<string, unknown>).not.toHaveProperty('polluted');
    expect(Object.prototype).toEqual({});
    // Prefill holds end at their 300 ms lease.
    await expect.poll(() => w.freeBlocks, { timeout: 5000 }).toBe(BLOCKS);
    expect(await normal('after')).toBe(before);
    (globalThis as { gc?: () => void }).gc?.();
    const grown = (process.memoryUsage().heapUsed - heap0) / 2 ** 20;
    console.log(`heap grown ${grown.toFixed(1)} MiB (replies kept: ${replies.length})`);
    expect(grown).toBeLessThan(128);
  }, 120_000);
});

describe('an answer that cannot be sent', () => {
  it('a chunk of a stream dropped: nothing after it goes out, the call ends in a FAILURE reply_dropped, not an answer with a hole', async () => {
    const w = await startWorker({ transport: 'zmq', blocks: BLOCKS });
    closers.push(() => w.close());
    const sent: Array<{ tag: string; r: ZmqReply }> = [];
    let chunks = 0;
    // As the reply sockets do: each send goes out later, in order, unless withheld by then; the third chunk is dropped.
    const d = new ZmqDispatch(w, (_, tag, r, skip) => {
      if (tag === 'GENERATION' && r.done === false && ++chunks === 3) return false;
      return new Promise<boolean>((resolve) =>
        setImmediate(() => {
          if (skip?.()) return resolve(false);
          sent.push({ tag, r });
          resolve(true);
        }),
      );
    });
    d.onMessage(
      encodeMessage('GENERATION', {
        msg_id: 'streamed',
        reply_to: 'tcp://127.0.0.1:5999',
        path: '/v1/completions',
        payload: { prompt: 'the lazy dog', max_tokens: 24, temperature: 0, stream: true },
      }),
    );
    await expect.poll(() => sent.find((x) => x.tag === 'FAILURE'), { timeout: 5000 }).toBeTruthy();
    await expect.poll(() => d.inFlight, { timeout: 5000 }).toBe(0);
    await new Promise((r) => setTimeout(r, 100));
    const last = sent.at(-1)!;
    expect(last.tag).toBe('FAILURE');
    expect(last.r).toMatchObject({ msg_id: 'streamed', status: 503, error: { code: 'reply_dropped' } });
    expect(sent.filter((x) => x.tag === 'GENERATION' && x.r.done !== false)).toEqual([]);
    // Chunks still queued when the drop was known are withheld too: the call is failed either way.
    expect(sent.filter((x) => x.tag === 'GENERATION').length).toBeLessThanOrEqual(2);
    expect(w.freeBlocks).toBe(BLOCKS);
  });
});

describe('msgpack bombs', () => {
  it('huge declared lengths, 1 MiB of nesting, 65,535 keys, extension types: dropped and counted, or refused 400, at once', async () => {
    const w = await startWorker({ transport: 'zmq', blocks: BLOCKS });
    closers.push(() => w.close());
    const replies: ZmqReply[] = [];
    const d = new ZmqDispatch(w, (_, __, r) => replies.push(r));
    const keys = [Buffer.from([0xde, 0xff, 0xff])];
    for (let i = 0; i < 65535; i++) keys.push(Buffer.from([0xcd, i >> 8, i & 255, 0xc0]));
    const bombs = [
      Buffer.from([0xdd, 0xff, 0xff, 0xff, 0xff]), // array32 of 4 G entries, none there
      Buffer.from([0xdf, 0xff, 0xff, 0xff, 0xff]), // map32 likewise
      Buffer.from([0xdb, 0xff, 0xff, 0xff, 0xff, 0x41]), // str32 of 4 GB
      Buffer.from([0xc6, 0xff, 0xff, 0xff, 0xff]), // bin32 of 4 GB
      Buffer.alloc(1 << 20, 0x91), // a million nested arrays
      Buffer.concat(Array.from({ length: 300_000 }, () => Buffer.from([0x81, 0xa1, 0x61]))), // nested maps
      Buffer.from([0xc7, 0x10, 0x65, ...Buffer.alloc(16, 0x41)]), // an extension type
      Buffer.concat(keys), // a map of 65,535 integer keys and no msg_id
    ];
    const t0 = performance.now();
    for (const b of bombs) expect(() => d.onMessage([Buffer.from('GENERATION'), b])).not.toThrow();
    const ms = performance.now() - t0;
    console.log(`${bombs.length} bombs in ${ms.toFixed(0)} ms`);
    expect(w.stats.messagesDropped).toBe(bombs.length);
    expect(replies).toEqual([]);
    expect(ms).toBeLessThan(10_000);
  });
});

describe('the ZeroMQ front over sockets', () => {
  const fds = () => fs.readdirSync('/proc/self/fd').length;

  async function rig(o: { maxBodyBytes?: number } = {}) {
    // The worker's own front is HTTP; this one is bound here, so the test sees its reply sockets.
    const w = await startWorker({ blocks: BLOCKS, leaseMs: 300 });
    closers.push(() => w.close());
    const front = await ZmqFront.bind(w, 'tcp://127.0.0.1:*', o.maxBodyBytes ?? 1 << 20);
    closers.push(() => front.close());
    const replies = new zmq.Pull({ linger: 0 });
    await replies.bind('tcp://127.0.0.1:*');
    const push = new zmq.Push({ linger: 0 });
    push.connect(front.address);
    closers.push(
      () => replies.close(),
      () => push.close(),
    );
    const to = replies.lastEndpoint!;
    /** Waits for the answer to msg_id (skipping others). */
    const answer = async (id: string, timeoutMs = 5000) => {
      const end = Date.now() + timeoutMs;
      for (;;) {
        const left = end - Date.now();
        if (left <= 0) throw new Error(`no answer to ${id}`);
        const got = await Promise.race([
          replies.receive(),
          new Promise<undefined>((r) => setTimeout(() => r(undefined), left)),
        ]);
        if (!got) throw new Error(`no answer to ${id}`);
        const body = unpackMap(got[1]) ?? {};
        const m = { tag: got[0].toString(), body };
        if (m.body.msg_id === id && (m.tag !== 'GENERATION' || m.body.done !== false)) return m;
      }
    };
    const normal = async (id: string, sender: zmq.Push = push) => {
      await sender.send(
        encodeMessage('GENERATION', {
          msg_id: id,
          reply_to: to,
          path: '/v1/completions',
          payload: { prompt: 'the lazy dog', max_tokens: 6, temperature: 0 },
        }),
      );
      const m = await answer(id);
      expect(m.tag, JSON.stringify(m.body)).toBe('GENERATION');
      return (m.body.payload as { choices: Array<{ text: string }> }).choices[0].text;
    };
    return { w, front, push, to, answer, normal, replies };
  }

  it('1,000 mutated messages on the wire (seed 4401): dropped ones counted, malformed ones with reply_to answered 400 with a code', async () => {
    const { w, push, to, answer, normal } = await rig();
    const before = await normal('before');
    // A message of garbage, and one that is well-formed but for its tag and msg_id.
    await push.send([Buffer.from('GENERATION'), Buffer.from([0xc1, 0xff, 0x00])]);
    await push.send(encodeMessage('GENERATION', { msg_id: 'only' } as never).slice(0, 1) as never);
    await push.send([Buffer.from('NOPE'), packr.pack({ msg_id: 'bad-tag', reply_to: to })]);
    const badTag = await answer('bad-tag');
    expect(badTag.tag).toBe('FAILURE');
    expect(badTag.body).toMatchObject({ status: 400, error: { code: 'invalid_message' } });
    await push.send(
      encodeMessage('GENERATION', { msg_id: 'bad-path', reply_to: to, path: { toString: 1 }, payload: {} } as never),
    );
    expect((await answer('bad-path')).body).toMatchObject({ status: 400, error: { code: 'invalid_message' } });
    await push.send(
      encodeMessage('GENERATION', {
        msg_id: 'bad-rid',
        reply_to: to,
        request_id: ['x'],
        payload: { prompt: 'x' },
      } as never),
    );
    expect((await answer('bad-rid')).body).toMatchObject({ status: 400, error: { code: 'invalid_message' } });
    expect(w.stats.messagesDropped).toBe(2);
    for (const m of messages(1000, 4401, to)) await push.send(m.frames);
    expect(await normal('after')).toBe(before);
    expect(w.stats.messagesDropped).toBeGreaterThan(50);
    await expect.poll(() => w.freeBlocks, { timeout: 5000 }).toBe(BLOCKS);
  }, 60_000);

  it('huge frames: one past maxBodyBytes and a 64-part message are dropped, the sender reconnects, the worker serves', async () => {
    const { w, push, normal } = await rig({ maxBodyBytes: 1 << 20 });
    const before = await normal('before');
    const rss0 = process.memoryUsage().rss;
    // ZMQ_MAXMSGSIZE: the frame is refused and its connection dropped; the PUSH reconnects by itself.
    await push.send([Buffer.from('GENERATION'), Buffer.alloc(2 << 20, 0x81)]);
    await push.send([Buffer.from('GENERATION'), Buffer.alloc(8 << 20, 0x81)]);
    expect(await normal('after-big')).toBe(before);
    // Parts each under the limit: a message ZeroMQ delivers whole, refused for its frame count.
    const parts = Array.from({ length: 64 }, () => Buffer.alloc(256 << 10, 7));
    const n = w.stats.messagesDropped;
    await push.send(parts);
    expect(await normal('after-parts')).toBe(before);
    expect(w.stats.messagesDropped).toBe(n + 1);
    console.log(`rss grown ${((process.memoryUsage().rss - rss0) / 2 ** 20).toFixed(0)} MiB`);
  }, 30_000);

  it('200 peers at once, each with its own PUSH socket: every HEALTH answered, descriptors back after', async () => {
    const { front, to, replies, normal } = await rig();
    const before = await normal('before');
    const peers = Array.from({ length: 200 }, () => new zmq.Push({ linger: 0 }));
    closers.push(() => {
      for (const p of peers) p.close();
    });
    for (const p of peers) p.connect(front.address);
    await Promise.all(peers.map((p, i) => p.send(encodeMessage('HEALTH', { msg_id: `peer-${i}`, reply_to: to }))));
    // Answers come in any order.
    const seen = new Set<string>();
    while (seen.size < 200) {
      const got = await Promise.race([replies.receive(), new Promise<undefined>((r) => setTimeout(r, 5000))]);
      if (!got) throw new Error(`${seen.size} of 200 answered`);
      const m = decodeMessage(got);
      expect(m.tag).toBe('HEALTH');
      seen.add(String(m.body.msg_id));
    }
    expect(await normal('after', peers[199])).toBe(before);
  }, 30_000);

  it('reply addresses that never read or do not answer: sends to them stay bounded, other proxies are answered at once', async () => {
    const { w, front, push, normal } = await rig();
    const before = await normal('before');
    // A PULL that is bound but never reads, and a port nobody listens on.
    const deaf = new zmq.Pull({ linger: 0, receiveHighWaterMark: 10 });
    await deaf.bind('tcp://127.0.0.1:*');
    closers.push(() => deaf.close());
    const nobody = `tcp://127.0.0.1:${await (await import('../helpers')).freePort()}`;
    const fd0 = fds();
    const heap0 = process.memoryUsage().heapUsed;
    for (let i = 0; i < 3000; i++) {
      await push.send(encodeMessage('HEALTH', { msg_id: `deaf-${i}`, reply_to: deaf.lastEndpoint! }));
      await push.send(encodeMessage('HEALTH', { msg_id: `nobody-${i}`, reply_to: nobody }));
    }
    // Past ZeroMQ's own queue (1000) a send waits for room, 5 s each, one at a time.
    for (let i = 0; i < 3000; i++) await push.send(encodeMessage('HEALTH', { msg_id: `more-${i}`, reply_to: nobody }));
    // Served while those sends wait: each reply address has its own socket.
    const t0 = performance.now();
    expect(await normal('after')).toBe(before);
    console.log(`answered in ${Math.round(performance.now() - t0)} ms behind 9,000 replies nobody reads`);
    const pending = front.pendingReplies;
    console.log(
      `pending replies ${pending}, dropped ${w.stats.repliesDropped}, heap +${((process.memoryUsage().heapUsed - heap0) / 2 ** 20).toFixed(1)} MiB, fds +${fds() - fd0}`,
    );
    expect(pending).toBeLessThanOrEqual(2 * 1024);
    expect(w.stats.repliesDropped).toBeGreaterThan(0);
    front.close();
  }, 60_000);
});

describe("the proxy's reply socket", () => {
  it('1,000 mutated replies (seed 4402) and a frame past 64 MiB: dropped and counted, the next call answered', async () => {
    const w = await startWorker({ transport: 'zmq', blocks: BLOCKS });
    closers.push(() => w.close());
    const t = await new ZmqTransport().bind();
    closers.push(() => t.close());
    const call = async () => {
      const a = await t.call({
        stage: 'decode',
        worker: { address: w.address } as never,
        path: '/v1/completions',
        body: { prompt: 'the lazy dog', max_tokens: 6, temperature: 0 },
        requestId: `r-${Math.random()}`,
        signal: AbortSignal.timeout(10_000),
        stream: false,
      });
      expect(a.status).toBe(200);
      return (a.json as { choices: Array<{ text: string }> }).choices[0].text;
    };
    const before = await call();
    const evil = new zmq.Push({ linger: 0 });
    closers.push(() => evil.close());
    evil.connect(t.replyAddress);
    const all = messages(1000, 4402, 'tcp://127.0.0.1:1');
    for (const m of all) await evil.send(m.frames);
    await evil.send([Buffer.from('GENERATION'), Buffer.alloc(65 << 20, 1)]);
    expect(await call()).toBe(before);
    await expect.poll(() => t.repliesDropped, { timeout: 5000 }).toBeGreaterThan(100);
    console.log(`proxy: ${t.repliesDropped} of 1,000 mutated replies dropped (the rest name no call)`);
  }, 60_000);
});
