// vLLM's POST /inference/v1/generate (token ids in and out, top-level
// kv_transfer_params, also read from sampling_params.extra_args) on workers
// and through the proxy (P/D on both transports, and in front of a
// vLLM-format server), its checks (typed 400 / 404, never a crash), and the
// last chunk of a streamed answer carrying kv_transfer_params (vLLM #40186).
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { buildKvTransferParams } from '../../lib/handshake/wire';
import { startProxy, startWorker } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import type { FrontHandler, Sink } from '../../lib/serving/worker/fronts/front';
import { handleGenerate } from '../../lib/serving/worker/fronts/generate-route';
import { serveTrio } from '../helpers';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

const GEN = '/inference/v1/generate';
// biome-ignore lint/suspicious/noExplicitAny: answers are JSON read field by field
type Json = Record<string, any>;
const ids = (s: string) => Array.from(Buffer.from(s, 'utf8'));
const text = (t: number[]) => Buffer.from(t).toString('utf8');

async function post(url: string, body: unknown, headers: Record<string, string> = {}) {
  const r = await fetch(`${url}${GEN}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const raw = await r.text();
  if ((r.headers.get('content-type') ?? '').includes('text/event-stream')) {
    expect(raw.endsWith('data: [DONE]\n\n')).toBe(true);
    const chunks = raw
      .split('\n\n')
      .filter((l) => l.startsWith('data: {'))
      .map((l) => JSON.parse(l.slice(6)));
    return { status: r.status, chunks, json: undefined as Json | undefined };
  }
  return { status: r.status, chunks: undefined, json: JSON.parse(raw) as Json };
}

/** What the synthetic model answers in ids: its tokens are bytes, so max_tokens bytes of its words. */
const expectedIds = (prompt: string, maxTokens: number) =>
  expectedCompletion(prompt, maxTokens).join(' ').slice(0, maxTokens);
const tokensOf = (chunks: Array<Json>) => chunks.flatMap((c) => c.choices?.[0]?.token_ids ?? []);

describe('generate on a worker (synthetic model)', () => {
  it('token ids in, token ids out, ids named after X-Request-Id, no params unless asked', async () => {
    const w = await startWorker({ name: 'G0' });
    closers.push(() => w.close());
    const prompt = 'tokens in, tokens out';
    const r = await post(
      w.address,
      { token_ids: ids(prompt), sampling_params: { max_tokens: 5 }, model: w.modelId },
      { 'x-request-id': 'abc' },
    );
    expect(r.status, JSON.stringify(r.json)).toBe(200);
    expect(r.json!.request_id).toBe('generate-tokens-abc');
    expect(text(r.json!.choices[0].token_ids)).toBe(expectedIds(prompt, 5));
    expect(r.json!.choices[0].finish_reason).toBe('length');
    expect(r.json!.usage.prompt_tokens).toBe(ids(prompt).length);
    expect(r.json!.kv_transfer_params).toBeNull();
    // No header: the body's request_id names it.
    const r2 = await post(w.address, { token_ids: ids(prompt), sampling_params: { max_tokens: 1 }, request_id: 'xyz' });
    expect(r2.json!.request_id).toBe('generate-tokens-xyz');
    // max_tokens omitted: not capped at 16 (as vLLM).
    const r3 = await post(w.address, { token_ids: ids(prompt), sampling_params: {} });
    expect(r3.json!.usage.completion_tokens).toBeGreaterThan(16);
  });

  it('prefill with top-level or extra_args params, decode with either: the right tokens', async () => {
    const p = await startWorker({ name: 'GP' });
    const d = await startWorker({ name: 'GD' });
    closers.push(
      () => p.close(),
      () => d.close(),
    );
    const prompt = 'a prompt long enough to take several blocks of sixteen tokens each';
    const want = expectedIds(prompt, 7);
    const ask = { do_remote_decode: true, do_remote_prefill: false };
    for (const where of ['top', 'extra'] as const) {
      const place = (kv: object, sp: object) =>
        where === 'top'
          ? { sampling_params: sp, kv_transfer_params: kv }
          : { sampling_params: { ...sp, extra_args: { kv_transfer_params: kv } } };
      const pre = await post(p.address, { token_ids: ids(prompt), ...place(ask, { max_tokens: 1 }) });
      expect(pre.status, JSON.stringify(pre.json)).toBe(200);
      const kv = pre.json!.kv_transfer_params;
      expect(kv.remote_block_ids.flat().length).toBe(Math.ceil(ids(prompt).length / 16));
      expect(pre.json!.choices[0].finish_reason).toBe('length');
      const dec = await post(d.address, { token_ids: ids(prompt), ...place(kv, { max_tokens: 7 }) });
      expect(dec.status, JSON.stringify(dec.json)).toBe(200);
      expect(text(dec.json!.choices[0].token_ids)).toBe(want);
      expect(dec.json!.nixl_node.kv_moved).toBe(true);
      expect(dec.json!.nixl_node.verified_bytes).toBeGreaterThan(0);
    }
    // Both places: the top level wins (extra_args names a prefill that never happened).
    const pre = await post(p.address, {
      token_ids: ids(prompt),
      sampling_params: { max_tokens: 1 },
      kv_transfer_params: ask,
    });
    const forged = { ...pre.json!.kv_transfer_params, remote_request_id: 'kv-0-nothing' };
    const dec = await post(d.address, {
      token_ids: ids(prompt),
      sampling_params: { max_tokens: 3, extra_args: { kv_transfer_params: forged } },
      kv_transfer_params: pre.json!.kv_transfer_params,
    });
    expect(dec.status, JSON.stringify(dec.json)).toBe(200);
    expect(text(dec.json!.choices[0].token_ids)).toBe(expectedIds(prompt, 3));
  });

  it('hostile or wrong input answers a typed 4xx and the worker keeps serving', async () => {
    const w = await startWorker({ name: 'GH', maxBodyBytes: 1 << 20 });
    closers.push(() => w.close());
    const ok = { token_ids: ids('hi'), sampling_params: { max_tokens: 2 } };
    const cases: Array<[unknown, number, RegExp]> = [
      [{ sampling_params: {} }, 400, /token_ids/],
      [{ token_ids: [], sampling_params: {} }, 400, /at least one/],
      [{ token_ids: [104, -1], sampling_params: {} }, 400, /token_ids\[1\].*negative/],
      [{ token_ids: [104, 256], sampling_params: {} }, 400, /outside the vocabulary/],
      [{ token_ids: [1e300], sampling_params: {} }, 400, /token_ids\[0\]/],
      [{ token_ids: [1.5], sampling_params: {} }, 400, /integer/],
      [{ token_ids: ['104'], sampling_params: {} }, 400, /integer/],
      [{ token_ids: [null], sampling_params: {} }, 400, /integer/],
      [{ token_ids: 'hello', sampling_params: {} }, 400, /token_ids/],
      [{ token_ids: { 0: 1 }, sampling_params: {} }, 400, /token_ids/],
      [{ token_ids: [104] }, 400, /sampling_params/],
      [{ token_ids: [104], sampling_params: [1] }, 400, /sampling_params/],
      [{ ...ok, sampling_params: { max_tokens: 0 } }, 400, /max_tokens/],
      [{ ...ok, sampling_params: { max_tokens: 'ten' } }, 400, /max_tokens/],
      [{ ...ok, sampling_params: { n: 4 } }, 400, /'sampling_params.n'/],
      [{ ...ok, sampling_params: { temperature: -1 } }, 400, /temperature/],
      [{ ...ok, sampling_params: { logprobs: 5 } }, 400, /logprobs/],
      [{ ...ok, sampling_params: { stop_token_ids: [2] } }, 400, /stop_token_ids/],
      [{ ...ok, sampling_params: { extra_args: 'x' } }, 400, /extra_args/],
      [{ ...ok, sampling_params: { extra_args: { kv_transfer_params: 7 } } }, 400, /extra_args.kv_transfer_params/],
      [{ ...ok, kv_transfer_params: [] }, 400, /kv_transfer_params/],
      [{ ...ok, kv_transfer_params: { remote_block_ids: 'x', do_remote_prefill: true } }, 400, /kv_transfer_params/],
      [{ ...ok, stream: 'yes' }, 400, /stream/],
      [{ ...ok, features: { mm_hashes: {} } }, 400, /features/],
      [{ ...ok, model: 'no-such-model' }, 404, /does not exist/],
      // 200,000 ids: within the body limit, more than the KV cache holds.
      [{ token_ids: Array(200_000).fill(97), sampling_params: { max_tokens: 1 } }, 400, /KV cache/],
      ['not json', 400, /JSON/],
      [[1, 2, 3], 400, /object/],
    ];
    for (const [body, status, message] of cases) {
      const r = await post(w.address, body);
      expect(r.status, JSON.stringify(body).slice(0, 80)).toBe(status);
      expect(r.json!.error.message).toMatch(message);
      expect(typeof r.json!.error.type).toBe('string');
    }
    const big = await post(w.address, { token_ids: Array(600_000).fill(97), sampling_params: {} });
    expect(big.status).toBe(413);
    const after = await post(w.address, ok);
    expect(after.status).toBe(200);
  });
});

describe('the last streamed chunk carries kv_transfer_params (vLLM #40186)', () => {
  it('a streamed prefill on /v1/completions, /v1/chat/completions and generate; the decode uses them', async () => {
    const p = await startWorker({ name: 'SP' });
    const d = await startWorker({ name: 'SD' });
    closers.push(
      () => p.close(),
      () => d.close(),
    );
    const prompt = 'stream me the params';
    const ask = { do_remote_decode: true, do_remote_prefill: false };
    const routes: Array<[string, Record<string, unknown>]> = [
      ['/v1/completions', { prompt, max_tokens: 1 }],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: prompt }], max_tokens: 1 }],
      [GEN, { token_ids: ids(prompt), sampling_params: { max_tokens: 1 } }],
    ];
    for (const [route, body] of routes) {
      const r = await fetch(`${p.address}${route}`, {
        method: 'POST',
        body: JSON.stringify({
          ...body,
          stream: true,
          stream_options: { include_usage: true },
          kv_transfer_params: ask,
        }),
      });
      expect(r.headers.get('content-type')).toMatch(/text\/event-stream/);
      const sse = await r.text();
      expect(sse.endsWith('data: [DONE]\n\n')).toBe(true);
      const chunks = sse
        .split('\n\n')
        .filter((l) => l.startsWith('data: {'))
        .map((l) => JSON.parse(l.slice(6)));
      const last = chunks.at(-1)!;
      expect(last.kv_transfer_params?.remote_block_ids, route).toBeDefined();
      expect(last.choices[0].finish_reason).toBe('length');
      expect(last.usage.prompt_tokens).toBeGreaterThan(0);
      for (const c of chunks.slice(0, -1)) expect(c.kv_transfer_params).toBeUndefined();
      // The params a streaming client got continue the request on a decode.
      const dec = await fetch(`${d.address}${route}`, {
        method: 'POST',
        body: JSON.stringify({
          ...body,
          max_tokens: 4,
          sampling_params: { max_tokens: 4 },
          kv_transfer_params: last.kv_transfer_params,
        }),
      });
      const j = await dec.json();
      expect(dec.status, JSON.stringify(j)).toBe(200);
      expect(j.nixl_node.kv_moved).toBe(true);
    }
  });
});

describe('generate through the proxy', () => {
  for (const transport of ['http', 'zmq'] as const) {
    it(`P/D over ${transport}: the tokens a single worker gives, streamed or not`, async () => {
      const { proxy, prefill, decode } = await serveTrio(closers, { transport });
      const prompt = `disaggregated tokens over ${transport}, `.repeat(3);
      const want = expectedIds(prompt, 6);
      const r = await post(proxy.url, { token_ids: ids(prompt), sampling_params: { max_tokens: 6 } });
      expect(r.status, JSON.stringify(r.json)).toBe(200);
      expect(text(r.json!.choices[0].token_ids)).toBe(want);
      expect(r.json!.nixl_node.kv_moved).toBe(true);
      const s = await post(proxy.url, { token_ids: ids(prompt), sampling_params: { max_tokens: 6 }, stream: true });
      expect(s.status).toBe(200);
      expect(text(tokensOf(s.chunks!))).toBe(want);
      expect(prefill.stats.prefills).toBe(2);
      expect(decode.stats.decodes).toBe(2);
      // Clients do not send params; the proxy does.
      const bad = await post(proxy.url, { token_ids: [97], sampling_params: {}, kv_transfer_params: {} });
      expect(bad.status).toBe(400);
      const nested = await post(proxy.url, {
        token_ids: [97],
        sampling_params: { extra_args: { kv_transfer_params: { do_remote_prefill: true } } },
      });
      expect(nested.status).toBe(400);
      const empty = await post(proxy.url, { token_ids: [], sampling_params: {} });
      expect(empty.status).toBe(400);
      const unknown = await post(proxy.url, { token_ids: [97], sampling_params: {}, model: 'no-such-model' });
      expect(unknown.status).toBe(404);
      expect(JSON.stringify(unknown.json)).toMatch(/does not exist/);
    });
  }

  it('in front of vLLM-format servers: the legs vLLM expects, the final chunk passed on', async () => {
    const seen: Array<{ path: string; rid: string | undefined; body: Json }> = [];
    const pParams = buildKvTransferParams({
      remoteBlockIds: [[3, 4]],
      remoteEngineId: 'vllm-P',
      remoteRequestId: 'generate-tokens-x-0a1b2c3d',
      remoteHost: '127.0.0.1',
      remotePort: 5600,
      tpSize: 1,
      remoteNumTokens: 20,
      remoteBlocksExpiryTime: null,
    } as Parameters<typeof buildKvTransferParams>[0]);
    const dParams = { ...pParams, remote_engine_id: 'vllm-D', remote_num_tokens: 26 };
    const server = http.createServer(async (req, res) => {
      if (req.method === 'GET') return void res.writeHead(200).end();
      let raw = '';
      for await (const c of req) raw += c;
      const body = JSON.parse(raw);
      seen.push({ path: req.url!, rid: req.headers['x-request-id'] as string | undefined, body });
      if (body.kv_transfer_params?.do_remote_decode) {
        const j = JSON.stringify({
          request_id: 'generate-tokens-x',
          choices: [{ index: 0, token_ids: [42], finish_reason: 'length', logprobs: null }],
          kv_transfer_params: pParams,
        });
        return void res.writeHead(200, { 'content-type': 'application/json' }).end(j);
      }
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      res.write(
        `data: ${JSON.stringify({ request_id: 'd', choices: [{ index: 0, token_ids: [7, 8], finish_reason: null }] })}\n\n`,
      );
      res.write(
        `data: ${JSON.stringify({ request_id: 'd', choices: [{ index: 0, token_ids: [9], finish_reason: 'length' }], kv_transfer_params: dParams })}\n\n`,
      );
      res.end('data: [DONE]\n\n');
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    closers.push(() => new Promise((r) => server.close(r)));
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    const proxy = await startProxy({ prefill: [url], decode: [url], healthIntervalMs: 0 });
    closers.push(() => proxy.close());
    const r = await post(proxy.url, {
      model: 'served',
      token_ids: [1, 2, 3],
      sampling_params: { max_tokens: 3, min_tokens: 2, temperature: 0 },
      stream: true,
      stream_options: { include_usage: true },
    });
    expect(r.status).toBe(200);
    expect(tokensOf(r.chunks!)).toEqual([7, 8, 9]);
    expect(r.chunks!.at(-1)!.kv_transfer_params).toEqual(dParams);
    const [pre, dec] = seen;
    expect(pre.path).toBe(GEN);
    expect(pre.body.stream).toBe(false);
    expect(pre.body.stream_options).toBeUndefined();
    expect(pre.body.sampling_params.max_tokens).toBe(1);
    expect(pre.body.sampling_params.min_tokens).toBeUndefined();
    expect(pre.body.kv_transfer_params.do_remote_decode).toBe(true);
    expect(pre.body.sampling_params.extra_args.kv_transfer_params).toEqual(pre.body.kv_transfer_params);
    expect(pre.body.token_ids).toEqual([1, 2, 3]);
    expect(dec.path).toBe(GEN);
    expect(dec.body.stream).toBe(true);
    expect(dec.body.sampling_params).toMatchObject({ max_tokens: 3, min_tokens: 2 });
    expect(dec.body.kv_transfer_params).toEqual(pParams);
    expect(dec.body.sampling_params.extra_args.kv_transfer_params).toEqual(pParams);
    expect(pre.rid).toBeDefined();
    expect(dec.rid).toBe(pre.rid);
  });
});

describe('generate honours max_tokens in token ids', () => {
  /** The ids an answer returns, and the completion tokens its usage counts. */
  async function generated(url: string, maxTokens: number, stream: boolean) {
    const r = await post(url, {
      token_ids: ids('count my tokens, not my words: '.repeat(3)),
      sampling_params: { max_tokens: maxTokens },
      stream,
      ...(stream ? { stream_options: { include_usage: true } } : {}),
    });
    expect(r.status, JSON.stringify(r.json)).toBe(200);
    const out = stream ? tokensOf(r.chunks!) : (r.json!.choices[0].token_ids as number[]);
    const usage = stream ? r.chunks!.at(-1)!.usage : r.json!.usage;
    return { out, usage };
  }

  it('on a worker and through the proxy (HTTP, ZeroMQ), streamed or not: at most max_tokens ids, usage counts them', async () => {
    const w = await startWorker({ name: 'GM' });
    closers.push(() => w.close());
    const targets: Array<[string, string]> = [['worker', w.address]];
    for (const transport of ['http', 'zmq'] as const)
      targets.push([`proxy ${transport}`, (await serveTrio(closers, { transport })).proxy.url]);
    for (const [where, url] of targets)
      for (const stream of [false, true])
        for (const n of [1, 4, 9]) {
          const { out, usage } = await generated(url, n, stream);
          const what = `${where}, ${stream ? 'streamed' : 'whole'}, max_tokens ${n}`;
          expect(out.length, what).toBeGreaterThan(0);
          expect(out.length, what).toBeLessThanOrEqual(n);
          expect(usage.completion_tokens, what).toBe(out.length);
          expect(usage.total_tokens, what).toBe(usage.prompt_tokens + out.length);
        }
  }, 60_000);
});

describe('generate on a model whose text encodes to more ids than it sampled', () => {
  it('the ids are cut at max_tokens (finish_reason length) and usage counts those returned', async () => {
    // A tokenizer that spells each character twice: 'abc' (3 tokens sampled) encodes to 6 ids.
    const tokenizer = {
      vocabSize: 256,
      encode: (t: string) => Array.from(Buffer.from(t.replace(/./g, '$&$&'))),
      decode: (i: number[]) => Buffer.from(i).toString(),
    };
    const usage = { prompt_tokens: 2, completion_tokens: 3, total_tokens: 5 };
    const w = {
      modelId: 'm',
      model: { tokenizer },
      handle: async ({ body, sink }: { body: Json; sink: Sink }) => {
        if (body.stream !== true)
          return sink.end(200, { model: 'm', choices: [{ index: 0, text: 'abc', finish_reason: 'stop' }], usage });
        sink.chunk({ choices: [{ index: 0, text: 'ab', finish_reason: null }] });
        sink.chunk({ choices: [{ index: 0, text: 'c', finish_reason: null }] });
        sink.chunk({ choices: [{ index: 0, text: '', finish_reason: 'stop' }] });
        sink.chunk({ choices: [], usage });
        sink.end(200);
      },
    } as unknown as FrontHandler;
    for (const stream of [false, true]) {
      const chunks: Json[] = [];
      let whole: Json | undefined;
      const sink: Sink = { chunk: (c) => chunks.push(c), end: (_s, b) => (whole = b) };
      const body = { token_ids: [104, 105], sampling_params: { max_tokens: 4 }, stream };
      await handleGenerate(w, {
        path: '/inference/v1/generate',
        body,
        requestId: 'x',
        signal: new AbortController().signal,
        sink,
      });
      const out = stream ? tokensOf(chunks) : whole!.choices[0].token_ids;
      expect(out, `stream ${stream}`).toEqual(ids('aabb'));
      const last = stream ? chunks.at(-1)! : whole!;
      expect(last.usage).toEqual({ prompt_tokens: 2, completion_tokens: 4, total_tokens: 6 });
      const end = stream ? chunks.find((c) => c.choices[0]?.finish_reason) : whole;
      expect(end!.choices[0].finish_reason).toBe('length');
    }
  });
});
