// Bidirectional KV (vLLM #32553) on the synthetic model: a decode that ends a
// turn holds the conversation's KV and returns kv_transfer_params naming it;
// the next turn's prefill reads what is provably its prompt's prefix, and the
// decode of that turn checks every byte of the whole prompt's KV. Anything
// that does not prove to be the prompt's prefix is recomputed, never read.
import type { ChildProcess } from 'node:child_process';
import { afterEach, describe, expect, it } from 'vitest';
import { start } from '../../dist/demo/serving';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import { serveTrio } from '../helpers';

const closers: Array<() => unknown> = [];
const procs: ChildProcess[] = [];
afterEach(async () => {
  for (const p of procs.splice(0)) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
  for (const c of closers.splice(0).reverse()) await c();
});

// biome-ignore lint/suspicious/noExplicitAny: answers are JSON read field by field
type Json = Record<string, any>;

async function post(w: Worker, body: object, path = '/v1/completions'): Promise<{ status: number; json: Json }> {
  const r = await fetch(`${w.address}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: r.status, json: (await r.json()) as Json };
}

async function stream(w: Worker, body: object, path = '/v1/completions'): Promise<Json[]> {
  const r = await fetch(`${w.address}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, stream: true }),
  });
  const raw = await r.text();
  expect(raw.endsWith('data: [DONE]\n\n')).toBe(true);
  return raw
    .split('\n\n')
    .filter((l) => l.startsWith('data: {'))
    .map((l) => JSON.parse(l.slice(6)));
}

const ASK = { do_remote_decode: true, do_remote_prefill: false };
const HISTORY = 'user: tell me a long story about the alphabet and its many letters, please, in words\n';

/** A prefill and a decode, both bidirectional. */
async function pair(
  o: { secret?: string; ttlMs?: number; wire?: 'v12' | 'v0.13'; threshold?: number; decodeSkewMs?: number } = {},
) {
  const common = { bidirectionalKv: true, kvSecret: o.secret, wire: o.wire, kvRecomputeThreshold: o.threshold };
  const p = await startWorker({ name: `MP-${Math.random()}`, ...common });
  const d = await startWorker({
    name: `MD-${Math.random()}`,
    decoderKvTtlMs: o.ttlMs,
    testHooks: { clockSkewMs: o.decodeSkewMs },
    ...common,
  });
  closers.push(
    () => p.close(),
    () => d.close(),
  );
  return { p, d };
}

/** One turn by hand, as the proxy runs it: prefill (with the previous turn's params, if any), then decode. */
async function turn(p: Worker, d: Worker, prompt: string, maxTokens: number, previous?: Json) {
  const pre = await post(p, { prompt, max_tokens: 1, kv_transfer_params: previous ?? ASK });
  expect(pre.status, JSON.stringify(pre.json)).toBe(200);
  const dec = await post(d, { prompt, max_tokens: maxTokens, kv_transfer_params: pre.json.kv_transfer_params });
  expect(dec.status, JSON.stringify(dec.json)).toBe(200);
  expect(dec.json.choices[0].text).toBe(expectedCompletion(prompt, maxTokens).join(' '));
  return { pre: pre.json, dec: dec.json };
}

describe('bidirectional KV: a decode holds its turn, the next prefill reads it', () => {
  for (const wire of ['v12', 'v0.13'] as const) {
    it(`turn 2 reads turn 1's KV from the decode and answers right (${wire}, signed)`, async () => {
      const { p, d } = await pair({ secret: 's3cret', wire });
      const t1 = await turn(p, d, HISTORY, 12);
      const next = t1.dec.kv_transfer_params;
      expect(next.do_remote_decode).toBe(true);
      expect(next.do_remote_prefill).toBe(false);
      expect(next.remote_engine_id).toBe(d.name);
      expect(typeof next.nixl_node_signature).toBe('string');
      const held = HISTORY + t1.dec.choices[0].text;
      expect(next.nixl_node_prefix_tokens).toBe(Buffer.byteLength(held));
      if (wire === 'v12') {
        expect(next.remote_num_tokens).toBe(Buffer.byteLength(held));
        expect(next.remote_blocks_expiry_time).toBeGreaterThan(performance.now() / 1000);
        expect(next.transfer_mode).toBe('pull');
        expect(Array.isArray(next.remote_block_ids[0])).toBe(true);
      } else expect(typeof next.remote_block_ids[0]).toBe('number');
      expect(d.turns!.held).toBe(1);
      const prompt2 = `${held}\nuser: and now tell me more about the letter q and the letter z, please\n`;
      const t2 = await turn(p, d, prompt2, 9, next);
      const reused = Math.floor(Buffer.byteLength(held) / 16) * 16;
      expect(t2.pre.nixl_node.kv_reused_tokens).toBe(reused);
      expect(t2.pre.nixl_node.kv_reuse_skipped).toBeUndefined();
      expect(p.turns!.stats).toMatchObject({ turnsReused: 1, reusedTokens: reused });
      // The read freed turn 1's hold on the decode; turn 2's hold is there.
      await expect.poll(() => d.stats.freedByRead).toBe(1);
      expect(d.turns!.held).toBe(1);
    });
  }

  it("the hold's expiry is in the decode's clock: a decode whose clock is an hour off is read in time, and not after", async () => {
    for (const skew of [3_600_000, -3_600_000]) {
      const { p, d } = await pair({ decodeSkewMs: skew, ttlMs: 3000 });
      const t1 = await turn(p, d, HISTORY, 12);
      expect(t1.dec.kv_transfer_params.remote_blocks_expiry_time * 1000).toBeCloseTo(
        performance.now() + skew + 3000,
        -4,
      );
      const prompt2 = `${HISTORY}${t1.dec.choices[0].text}\nuser: more\n`;
      const t2 = await turn(p, d, prompt2, 4, t1.dec.kv_transfer_params);
      expect(t2.pre.nixl_node.kv_reused_tokens).toBeGreaterThan(64);
      const prompt3 = `${prompt2}${t2.dec.choices[0].text}\nuser: more\n`;
      const t3 = await turn(p, d, prompt3, 4);
      await expect.poll(() => d.turns!.held, { timeout: 5000 }).toBe(0);
      const late = await turn(p, d, `${prompt3}${t3.dec.choices[0].text}\n`, 4, t3.dec.kv_transfer_params);
      expect(late.pre.nixl_node.kv_reuse_skipped).toBe('pull-failed:expired');
      expect(late.pre.nixl_node.kv_reused_tokens).toBe(0);
    }
  });

  it('a decode without bidirectional KV returns no params and holds nothing (vLLM: every turn a miss)', async () => {
    const p = await startWorker({ name: 'Off-P' });
    const d = await startWorker({ name: 'Off-D' });
    closers.push(
      () => p.close(),
      () => d.close(),
    );
    const t = await turn(p, d, HISTORY, 6);
    expect(t.dec.kv_transfer_params).toBeUndefined();
    expect(d.turns).toBeUndefined();
    const chunks = await stream(d, {
      prompt: HISTORY,
      max_tokens: 3,
      kv_transfer_params: (await post(p, { prompt: HISTORY, max_tokens: 1, kv_transfer_params: ASK })).json
        .kv_transfer_params,
    });
    for (const c of chunks) expect(c.kv_transfer_params).toBeUndefined();
  });

  it("vLLM's example proxy: its miss params (nulls) are a plain prefill; its hit params (D's, as sent) are read", async () => {
    const { p, d } = await pair({ secret: 'k' });
    const miss = {
      do_remote_decode: true,
      do_remote_prefill: false,
      remote_engine_id: null,
      remote_block_ids: null,
      remote_host: null,
      remote_port: null,
    };
    const t1 = await turn(p, d, HISTORY, 12, miss);
    expect(t1.pre.nixl_node.kv_reused_tokens).toBeUndefined();
    // The proxy forces the two flags on D's dict and passes the rest as it came.
    const hit = { ...t1.dec.kv_transfer_params, do_remote_decode: true, do_remote_prefill: false };
    const t2 = await turn(p, d, `${HISTORY}${t1.dec.choices[0].text}\nuser: more\n`, 4, hit);
    expect(t2.pre.nixl_node.kv_reused_tokens).toBeGreaterThan(64);
  });

  it("a decode's streamed last chunk carries its params; chat renders the answer as the assistant's turn", async () => {
    const { p, d } = await pair();
    const messages = [{ role: 'user', content: HISTORY.repeat(2) }];
    const pre = await post(p, { messages, max_tokens: 1, kv_transfer_params: ASK }, '/v1/chat/completions');
    const chunks = await stream(
      d,
      { messages, max_tokens: 10, kv_transfer_params: pre.json.kv_transfer_params },
      '/v1/chat/completions',
    );
    const last = chunks.at(-1)!;
    expect(last.choices[0].finish_reason).toBe('length');
    expect(last.kv_transfer_params.remote_engine_id).toBe(d.name);
    for (const c of chunks.slice(0, -1)) expect(c.kv_transfer_params).toBeUndefined();
    const answer = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
    const messages2 = [...messages, { role: 'assistant', content: answer }, { role: 'user', content: 'more!' }];
    const pre2 = await post(
      p,
      { messages: messages2, max_tokens: 1, kv_transfer_params: last.kv_transfer_params },
      '/v1/chat/completions',
    );
    expect(pre2.status, JSON.stringify(pre2.json)).toBe(200);
    expect(pre2.json.nixl_node.kv_reused_tokens).toBeGreaterThan(64);
    const dec2 = await post(
      d,
      { messages: messages2, max_tokens: 5, kv_transfer_params: pre2.json.kv_transfer_params },
      '/v1/chat/completions',
    );
    expect(dec2.status, JSON.stringify(dec2.json)).toBe(200);
  });
});

describe('bidirectional KV: whatever is not provably the prompt prefix is recomputed, never read', () => {
  it('an edited history is recomputed; the hold stays for its own conversation', async () => {
    const { p, d } = await pair({ secret: 'k' });
    const t1 = await turn(p, d, HISTORY, 12);
    const held = HISTORY + t1.dec.choices[0].text;
    const edited = `${held.replace('alphabet', 'alphabat')}\nuser: go on\n`;
    const t2 = await turn(p, d, edited, 5, t1.dec.kv_transfer_params);
    expect(t2.pre.nixl_node).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: 'mismatch' });
    // Nothing was read, nobody was told to free it: the hold is there for the real next turn.
    expect(d.stats.freedByRead).toBe(0);
    const t3 = await turn(p, d, `${held}\nuser: go on\n`, 5, t1.dec.kv_transfer_params);
    expect(t3.pre.nixl_node.kv_reused_tokens).toBeGreaterThan(0);
  });

  it('another conversation replayed, forged block ids, wrong or huge token counts: nothing of it is read', async () => {
    const { p, d } = await pair({ secret: 'k' });
    const a = await turn(p, d, HISTORY, 12);
    const b = await turn(p, d, `user: a different conversation about numbers, ${'one two three '.repeat(6)}\n`, 12);
    const pa = a.dec.kv_transfer_params;
    const pb = b.dec.kv_transfer_params;
    const promptA = `${HISTORY}${a.dec.choices[0].text}\nuser: next\n`;
    const cases: Array<[string, Json, string]> = [
      ["B's params with A's history", pb, 'mismatch'],
      ["A's params naming B's blocks", { ...pa, remote_block_ids: pb.remote_block_ids }, 'unauthenticated'],
      ["A's params naming B's request", { ...pa, remote_request_id: pb.remote_request_id }, 'unauthenticated'],
      ['a wrong token count', { ...pa, nixl_node_prefix_tokens: pa.nixl_node_prefix_tokens - 16 }, 'unauthenticated'],
      ['a huge remote_num_tokens', { ...pa, remote_num_tokens: 1e9 }, 'unauthenticated'],
      ['no signature', (({ nixl_node_signature: _, ...u }) => u)(pa), 'unauthenticated'],
      ["B's digest on A's params", { ...pa, nixl_node_prefix_sha256: pb.nixl_node_prefix_sha256 }, 'unauthenticated'],
    ];
    for (const [what, params, why] of cases) {
      const t = await turn(p, d, promptA, 4, params);
      expect(t.pre.nixl_node, what).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: why });
    }
    // Neither hold was read nor freed by any of it.
    expect(d.stats.freedByRead).toBe(0);
    expect(d.turns!.held).toBe(2 + cases.length);
  });

  it("a prefill's signed params with another remote_num_tokens are refused by the decode, nothing read", async () => {
    const { p, d } = await pair({ secret: 'k' });
    const pre = await post(p, { prompt: HISTORY, max_tokens: 1, kv_transfer_params: ASK });
    const kv = pre.json.kv_transfer_params;
    for (const n of [kv.remote_num_tokens + 1000, 1e9]) {
      const dec = await post(d, {
        prompt: HISTORY,
        max_tokens: 3,
        kv_transfer_params: { ...kv, remote_num_tokens: n },
      });
      expect(dec.status, JSON.stringify(dec.json)).toBe(400);
      expect(dec.json.error.message).toMatch(/signature/);
    }
    expect(p.stats.freedByRead).toBe(0);
  });

  it('unsigned deployments: counts and digests that do not add up are recomputed', async () => {
    const { p, d } = await pair();
    const a = await turn(p, d, HISTORY, 12);
    const pa = a.dec.kv_transfer_params;
    const promptA = `${HISTORY}${a.dec.choices[0].text}\nuser: next\n`;
    const cases: Array<[string, Json, string]> = [
      ['a huge remote_num_tokens', { ...pa, remote_num_tokens: 1e9 }, 'mismatch'],
      ['a huge prefix count', { ...pa, remote_num_tokens: 1e9, nixl_node_prefix_tokens: 1e9 }, 'mismatch'],
      ['a smaller count, same digest', { ...pa, nixl_node_prefix_tokens: 64, remote_num_tokens: 64 }, 'mismatch'],
      ['fewer blocks than tokens', { ...pa, remote_block_ids: [pa.remote_block_ids[0].slice(0, 2)] }, 'mismatch'],
      ['no digest (as a vLLM decode sends)', { ...pa, nixl_node_prefix_sha256: undefined }, 'unproven'],
      ['a malformed id list', { ...pa, remote_block_ids: [['x']] }, 'malformed'],
    ];
    for (const [what, params, why] of cases) {
      const t = await turn(p, d, promptA, 4, params);
      expect(t.pre.nixl_node, what).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: why });
    }
    expect(d.stats.freedByRead).toBe(0);
  });

  it('an expired hold, a decode gone, a prefill without bidirectional KV: recomputed, never an error', async () => {
    const { p, d } = await pair({ ttlMs: 300 });
    const a = await turn(p, d, HISTORY, 12);
    const promptA = `${HISTORY}${a.dec.choices[0].text}\nuser: next\n`;
    await expect.poll(() => d.turns!.held, { timeout: 5000 }).toBe(0);
    const late = await turn(p, d, promptA, 4, a.dec.kv_transfer_params);
    expect(late.pre.nixl_node.kv_reused_tokens).toBe(0);
    expect(late.pre.nixl_node.kv_reuse_skipped).toMatch(/^pull-failed:expired/);

    const plain = await startWorker({ name: 'MPlain' });
    closers.push(() => plain.close());
    const b = await turn(p, d, HISTORY, 12);
    const off = await turn(plain, d, `${HISTORY}${b.dec.choices[0].text}\nuser: next\n`, 4, b.dec.kv_transfer_params);
    expect(off.pre.nixl_node).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: 'bidirectional-off' });

    const d2 = await startWorker({ name: 'MD2', bidirectionalKv: true });
    closers.push(() => d2.close());
    const c = await turn(p, d2, HISTORY, 12);
    await d2.close();
    // Its side channel is closed: the handshake's attempts time out (shortened here), then the prefill recomputes.
    process.env.NIXL_HANDSHAKE_TIMEOUT = '0.3';
    closers.push(() => delete process.env.NIXL_HANDSHAKE_TIMEOUT);
    const gone = await turn(p, d, `${HISTORY}${c.dec.choices[0].text}\nuser: next\n`, 4, c.dec.kv_transfer_params);
    expect(gone.pre.nixl_node.kv_reused_tokens).toBe(0);
    expect(gone.pre.nixl_node.kv_reuse_skipped).toMatch(/^pull-failed:/);
  });

  it('a decode gone: turn 2 recomputes after one short handshake attempt, not 3 x 5 s', async () => {
    const { p } = await pair();
    const d = await startWorker({ name: `MGone-${Math.random()}`, bidirectionalKv: true });
    closers.push(() => d.close());
    const t1 = await turn(p, d, HISTORY, 12);
    await d.close();
    const prompt2 = `${HISTORY}${t1.dec.choices[0].text}\nuser: next\n`;
    const t0 = performance.now();
    const pre = await post(p, { prompt: prompt2, max_tokens: 1, kv_transfer_params: t1.dec.kv_transfer_params });
    const ms = performance.now() - t0;
    expect(pre.status).toBe(200);
    expect(pre.json.nixl_node).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: 'pull-failed:handshake' });
    // The default budget: one attempt of 1000 ms (the pull path's default is 3 x 5000 ms).
    expect(ms).toBeLessThan(2500);
  }, 30_000);

  it('under the recompute threshold: nothing read, the decode told to free its hold at once', async () => {
    const { p, d } = await pair({ threshold: 1000 });
    const a = await turn(p, d, HISTORY, 12);
    const t = await turn(p, d, `${HISTORY}${a.dec.choices[0].text}\nuser: next\n`, 4, a.dec.kv_transfer_params);
    expect(t.pre.nixl_node).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: 'below-threshold' });
    await expect.poll(() => d.stats.freedByRead).toBe(1);
  });
});

describe('the proxy carries the conversation', () => {
  async function ask(url: string, body: object, path = '/v1/completions') {
    const r = await fetch(`${url}${path}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
    const raw = await r.text();
    if (!(r.headers.get('content-type') ?? '').includes('text/event-stream'))
      return { status: r.status, json: JSON.parse(raw) as Json, text: '' };
    const chunks = raw
      .split('\n\n')
      .filter((l) => l.startsWith('data: {'))
      .map((l) => JSON.parse(l.slice(6)) as Json);
    return { status: r.status, json: chunks.at(-1)!, text: chunks.map((c) => c.choices?.[0]?.text ?? '').join('') };
  }

  for (const transport of ['http', 'zmq'] as const)
    for (const streamed of [false, true])
      it(`turn 2 through the proxy reuses turn 1's KV (${transport}${streamed ? ', streamed' : ''})`, async () => {
        const both = { bidirectionalKv: true, kvSecret: 'k' };
        const { proxy, decode } = await serveTrio(closers, { transport, prefill: both, decode: both });
        let prompt = HISTORY;
        let reusedBefore = 0;
        for (let t = 0; t < 3; t++) {
          const r = await ask(proxy.url, { prompt, max_tokens: 10, conversation_id: 'c1', stream: streamed });
          expect(r.status, JSON.stringify(r.json)).toBe(200);
          const text = streamed ? r.text : r.json.choices[0].text;
          expect(text).toBe(expectedCompletion(prompt, 10).join(' '));
          const reused = r.json.nixl_node.kv_reused_tokens;
          if (t === 0) expect(reused).toBe(0);
          else expect(reused).toBeGreaterThan(reusedBefore);
          reusedBefore = reused;
          prompt = `${prompt}${text}\nuser: and then? tell me about turn ${t + 2}\n`;
        }
        expect(proxy.conversations.hits).toBe(2);
        // The last turn's hold is kept for a turn 4; turn 1's and 2's were read and freed.
        expect(proxy.conversations.size).toBe(1);
        await expect.poll(() => decode.turns!.held).toBe(1);
        // Another conversation, or none, never gets it.
        const other = await ask(proxy.url, { prompt, max_tokens: 3, conversation_id: 'c2' });
        expect(other.json.nixl_node.kv_reused_tokens).toBe(0);
        const none = await ask(proxy.url, { prompt, max_tokens: 3 });
        expect(none.json.nixl_node.kv_reused_tokens).toBeUndefined();
        // The turn of a request without a conversation is released at once: c1's and c2's stay.
        await expect.poll(() => decode.stats.abortedHolds).toBe(1);
        expect(decode.turns!.held).toBe(2);
      });

  it('a turn whose prompt does not continue the held one: recomputed, and the proxy frees that hold', async () => {
    const both = { bidirectionalKv: true, kvSecret: 'k' };
    const { proxy, decode } = await serveTrio(closers, { prefill: both, decode: both });
    const t1 = await ask(proxy.url, { prompt: HISTORY, max_tokens: 8, conversation_id: 'e' });
    const edited = `${HISTORY.replace('story', 'poem')}${t1.json.choices[0].text}\nuser: go on\n`;
    const t2 = await ask(proxy.url, { prompt: edited, max_tokens: 8, conversation_id: 'e' });
    expect(t2.json.choices[0].text).toBe(expectedCompletion(edited, 8).join(' '));
    // The client sees why nothing was reused (the prefill's reason), streamed or not.
    expect(t2.json.nixl_node).toMatchObject({ kv_reused_tokens: 0, kv_reuse_skipped: 'mismatch' });
    // Turn 1's hold freed by the proxy (the prefill never frees what it did not prove); turn 2's kept.
    await expect.poll(() => decode.stats.abortedHolds).toBe(1);
    expect(decode.turns!.held).toBe(1);
  });

  it("a turn that fails (its prefill refuses it) frees the previous turn's hold on the decode at once", async () => {
    const both = { bidirectionalKv: true, kvSecret: 'k' };
    const { proxy, decode } = await serveTrio(closers, { prefill: { ...both, blocks: 16 }, decode: both });
    const t1 = await ask(proxy.url, { prompt: HISTORY, max_tokens: 8, conversation_id: 'f' });
    expect(decode.turns!.held).toBe(1);
    // More KV than the prefill's whole cache: a 400 (kv_request_too_large) before any read.
    const long = `${HISTORY}${t1.json.choices[0].text}\nuser: ${'more '.repeat(100)}\n`;
    const t2 = await ask(proxy.url, { prompt: long, max_tokens: 8, conversation_id: 'f' });
    expect(t2.status).toBe(400);
    await expect.poll(() => decode.turns!.held).toBe(0);
    expect(decode.stats.abortedHolds).toBe(1);
  });

  it('an entry evicted (more conversations than --max-conversations) frees its hold on the decode', async () => {
    const both = { bidirectionalKv: true };
    const { proxy, decode } = await serveTrio(closers, {
      prefill: both,
      decode: both,
      proxy: { conversations: { max: 2 } },
    });
    for (let i = 0; i < 5; i++) {
      const r = await ask(proxy.url, { prompt: `${HISTORY} ${i}`, max_tokens: 4, conversation_id: `c${i}` });
      expect(r.status).toBe(200);
    }
    expect(proxy.conversations.size).toBe(2);
    await expect.poll(() => decode.turns!.held).toBe(2);
    expect(decode.stats.abortedHolds).toBe(3);
  });

  it("a client's conversation_id must be a short string; its kv_transfer_params are refused", async () => {
    const { proxy } = await serveTrio(closers, {
      prefill: { bidirectionalKv: true },
      decode: { bidirectionalKv: true },
    });
    for (const bad of [7, '', 'x'.repeat(300), { a: 1 }]) {
      const r = await ask(proxy.url, { prompt: 'hi', max_tokens: 2, conversation_id: bad });
      expect(r.status).toBe(400);
      expect(r.json.error.message).toMatch(/conversation_id/);
    }
    const r = await ask(proxy.url, { prompt: 'hi', max_tokens: 2, kv_transfer_params: { remote_block_ids: [[1]] } });
    expect(r.status).toBe(400);
  });
});

describe('the command', () => {
  it('nixl-node worker --bidirectional-kv (processes) behind nixl-node proxy: turn 2 reuses turn 1', async () => {
    const flags = ['--bidirectional-kv', '--decoder-kv-ttl', '60', '--kv-recompute-threshold', '32', '--blocks', '64'];
    const pre = await start(['worker', '--name', 'cli-mp', ...flags], (p) => procs.push(p));
    const dec = await start(['worker', '--name', 'cli-md', ...flags], (p) => procs.push(p));
    const proxy = await startProxy({
      prefill: [String(pre.ready.address)],
      decode: [String(dec.ready.address)],
      healthIntervalMs: 0,
    });
    closers.push(() => proxy.close());
    const q = async (prompt: string) => {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt, max_tokens: 8, conversation_id: 'cli' }),
      });
      const j = (await r.json()) as Json;
      expect(r.status, JSON.stringify(j)).toBe(200);
      expect(j.choices[0].text).toBe(expectedCompletion(prompt, 8).join(' '));
      // The decode says how long it holds the turn: the proxy keeps the entry that long, less 5 s.
      expect(j.nixl_node.kv_hold_ms).toBe(60_000);
      return j;
    };
    const t1 = await q(HISTORY);
    const t2 = await q(`${HISTORY}${t1.choices[0].text}\nuser: more\n`);
    expect(t2.nixl_node.kv_reused_tokens).toBe(Math.floor(Buffer.byteLength(HISTORY + t1.choices[0].text) / 16) * 16);
  });
});

describe('generate endpoint (token ids)', () => {
  it('turn 2 of a token-id conversation through the proxy reuses turn 1', async () => {
    const both = { bidirectionalKv: true };
    const { proxy } = await serveTrio(closers, { prefill: both, decode: both });
    const gen = async (ids: number[]) => {
      const r = await fetch(`${proxy.url}/inference/v1/generate`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ token_ids: ids, sampling_params: { max_tokens: 6 }, conversation_id: 'g' }),
      });
      const j = (await r.json()) as Json;
      expect(r.status, JSON.stringify(j)).toBe(200);
      const out = j.choices[0].token_ids as number[];
      // The synthetic model's tokens are bytes: max_tokens 6 is 6 bytes of its words.
      expect(Buffer.from(out).toString()).toBe(
        expectedCompletion(Buffer.from(ids).toString(), 6).join(' ').slice(0, 6),
      );
      return { out, j };
    };
    const t1ids = Array.from(Buffer.from(HISTORY));
    const t1 = await gen(t1ids);
    expect(t1.j.kv_transfer_params.nixl_node_prefix_tokens).toBe(t1ids.length + t1.out.length);
    const t2 = await gen([...t1ids, ...t1.out, ...Buffer.from(' and then?')]);
    expect(t2.j.nixl_node.kv_reused_tokens).toBe(Math.floor((t1ids.length + t1.out.length) / 16) * 16);
  });
});

describe('held turns and the cache', () => {
  it('held turns take at most their share of the decode cache; past it the turn is not held', async () => {
    const p = await startWorker({ name: 'CapP', bidirectionalKv: true });
    const d = await startWorker({ name: 'CapD', bidirectionalKv: true, blocks: 40, heldTurnsShare: 0.5 });
    closers.push(
      () => p.close(),
      () => d.close(),
    );
    const held: boolean[] = [];
    const want: boolean[] = [];
    let taken = 0;
    for (let i = 0; i < 4; i++) {
      const prompt = `${HISTORY}conversation ${i}\n`;
      const n = Math.ceil(Buffer.byteLength(prompt + expectedCompletion(prompt, 12).join(' ')) / 16);
      want.push(taken + n <= 20);
      if (taken + n <= 20) taken += n;
      const t = await turn(p, d, prompt, 12);
      held.push(t.dec.kv_transfer_params !== undefined);
    }
    expect(held).toEqual(want);
    expect(want).toContain(false);
    expect(d.turns!.heldBlocks).toBe(taken);
    expect(d.freeBlocks).toBe(40 - taken);
    await expect(startWorker({ bidirectionalKv: true, heldTurnsShare: 2 })).rejects.toThrow(/heldTurnsShare/);
  });

  it('one worker in both pools: the next turn copies the held KV in place', async () => {
    const w = await startWorker({ name: 'Both', bidirectionalKv: true, kvSecret: 'k' });
    const proxy = await startProxy({ prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });
    closers.push(
      () => w.close(),
      () => proxy.close(),
    );
    let prompt = HISTORY;
    for (let t = 0; t < 3; t++) {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt, max_tokens: 8, conversation_id: 'both' }),
      });
      const j = (await r.json()) as Json;
      expect(r.status, JSON.stringify(j)).toBe(200);
      expect(j.choices[0].text).toBe(expectedCompletion(prompt, 8).join(' '));
      if (t > 0) expect(j.nixl_node.kv_reused_tokens).toBeGreaterThan(64);
      prompt = `${prompt}${j.choices[0].text}\nuser: again ${t}\n`;
    }
    expect(w.turns!.stats.turnsReused).toBe(2);
    expect(w.turns!.held).toBe(1);
  });
});
