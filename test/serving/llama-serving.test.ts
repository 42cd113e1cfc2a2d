// A real model (llama.cpp through node-llama-cpp, a generated GGUF) served
// disaggregated: proxy -> prefill worker -> KV pulled by nixl-node -> decode
// worker. Every answer must equal what node-llama-cpp generates alone in one
// process (LlamaCompletion / LlamaChatSession on a fresh context of the same
// size and thread count), and the decode must have used the KV it pulled
// (only the last prompt token evaluated again).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { BUILTIN, TINY, modelPath, writeGguf } from '../../lib/serving/models/test-models';
import { type Ask as RefAsk, OneProcess, askBody } from '../../demo/llama-reference';
import { loadNodeLlamaCpp } from '../../lib/serving/models/node-llama-cpp';
import { startProxy, startWorker, type Worker } from '../../lib/serving';
import { serveTrio } from '../helpers';

const CTX = { contextSize: 2048, threads: 1 };
const MAX_TOKENS = 12;
const SYSTEM = [{ role: 'system', content: 'You answer briefly.' }];
let nlc: typeof Nlc;
let ref: OneProcess;
let gguf: string;
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-test-'));

beforeAll(async () => {
  gguf = modelPath('tiny', dir);
  nlc = await loadNodeLlamaCpp();
  ref = await OneProcess.load(gguf, CTX);
}, 60_000);
afterAll(async () => {
  await ref?.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

type Ask = Omit<RefAsk, 'maxTokens'> & { maxTokens?: number; stream?: boolean };

const full = (a: Ask): RefAsk => ({ ...a, maxTokens: a.maxTokens ?? MAX_TOKENS, history: a.chat ? SYSTEM : undefined });

/** What node-llama-cpp generates for a request alone, in this process. */
async function reference(a: Ask): Promise<string> {
  return (await ref.generate(full(a))).text;
}

function body(a: Ask): Record<string, unknown> {
  return askBody(full(a), a.stream ?? false);
}

interface Answer {
  status: number;
  text: string;
  finish?: string;
  usage?: { prompt_tokens: number; completion_tokens: number };
  info?: Record<string, number | boolean | string>;
  error?: { message: string; type: string };
}

/** POSTs over HTTP; reads SSE when streamed. */
async function ask(url: string, a: Ask): Promise<Answer> {
  const res = await fetch(`${url}/v1/${a.chat ? 'chat/completions' : 'completions'}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body(a)),
  });
  return readAnswer(res, a);
}

async function readAnswer(res: Response, a: Ask): Promise<Answer> {
  if (!a.stream || res.status !== 200) {
    const j = (await res.json()) as {
      choices?: Array<{ text?: string; message?: { content: string }; finish_reason?: string }>;
      usage?: Answer['usage'];
      nixl_node?: Answer['info'];
      error?: Answer['error'];
    };
    const c = j.choices?.[0];
    return {
      status: res.status,
      text: (a.chat ? c?.message?.content : c?.text) ?? '',
      finish: c?.finish_reason,
      usage: j.usage,
      info: j.nixl_node,
      error: j.error,
    };
  }
  let text = '';
  let finish: string | undefined;
  let info: Answer['info'];
  for (const line of (await res.text()).split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    const c = JSON.parse(line.slice(6));
    text += (a.chat ? c.choices[0].delta.content : c.choices[0].text) ?? '';
    finish = c.choices[0].finish_reason ?? finish;
    info = c.nixl_node ?? info;
  }
  return { status: 200, text, finish, info };
}

/** 50+ prompts of different lengths, completions and chat, some streamed. */
function prompts(): Ask[] {
  const words = 'the cat sat on a warm mat while rain fell over quiet hills and rivers'.split(' ');
  return Array.from({ length: 52 }, (_, i) => ({
    chat: i % 3 === 2,
    stream: i % 4 === 1,
    text: Array.from({ length: 1 + ((i * 7) % 60) }, (_, j) => words[(i + j) % words.length]).join(' '),
  }));
}

const workerOptions = { model: '', ...CTX, parallel: 2, blockBytes: 4096, blocks: 1024 };

describe.each(['http', 'zmq'] as const)('llama through the proxy (%s)', (transport) => {
  const closers: Array<() => unknown> = [];
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
  });

  it('52 prompts at once: every answer equals one process generating alone, from the pulled KV', async () => {
    const w = { ...workerOptions, model: gguf };
    const { prefill, decode, proxy } = await serveTrio(closers, { transport, prefill: w, decode: w });
    const asks = prompts();
    const got = await Promise.all(asks.map((a) => ask(proxy.url, a)));
    for (const [i, a] of asks.entries()) {
      const g = got[i];
      expect(g.status, JSON.stringify(g.error)).toBe(200);
      expect(g.text, `prompt ${i}`).toBe(await reference(a));
      // The decode used the KV: it loaded every prompt token and evaluated only the last again.
      expect(g.info?.kv_moved).toBe(true);
      expect(Number(g.info?.kv_tokens_loaded)).toBeGreaterThan(1);
      expect(Number(g.info?.tokens_evaluated)).toBeLessThanOrEqual(MAX_TOKENS + 1);
      if (!a.stream) {
        expect(g.usage?.prompt_tokens).toBe(g.info?.kv_tokens_loaded);
        expect(g.usage?.completion_tokens).toBeGreaterThan(0);
        expect(g.usage?.completion_tokens).toBeLessThanOrEqual(MAX_TOKENS);
      }
    }
    expect(decode.stats.decodes).toBe(asks.length);
    expect(prefill.stats.prefills).toBe(asks.length);
    await expect.poll(() => prefill.freeBlocks, { timeout: 10_000 }).toBe(workerOptions.blocks);
    expect(decode.freeBlocks).toBe(workerOptions.blocks);
    // The proxy's /v1/models: what its healthy decode workers said they serve.
    await proxy.checkHealth();
    const models = (await (await fetch(`${proxy.url}/v1/models`)).json()) as { data: Array<{ id: string }> };
    expect(models.data.map((m) => m.id)).toEqual([TINY.name]);
  }, 240_000);
});

describe('llama worker', () => {
  const closers: Array<() => unknown> = [];
  afterAll(async () => {
    for (const c of closers.reverse()) await c();
  });
  let prefill: Worker;
  let decode: Worker;
  beforeAll(async () => {
    prefill = await startWorker({ ...workerOptions, model: gguf });
    decode = await startWorker({ ...workerOptions, model: gguf });
    closers.push(
      () => prefill.close(),
      () => decode.close(),
    );
  }, 60_000);

  /** Prefill on `p` (not streamed, as the proxy sends it), decode on `d` (no proxy): the decode's answer. */
  async function disaggregated(p: Worker, d: Worker, a: Ask): Promise<Answer> {
    const pre = await fetch(`${p.address}/v1/${a.chat ? 'chat/completions' : 'completions'}`, {
      method: 'POST',
      body: JSON.stringify({
        ...body(a),
        stream: false,
        max_tokens: 1,
        kv_transfer_params: { do_remote_decode: true },
      }),
    });
    const j = (await pre.json()) as { kv_transfer_params: Record<string, unknown> };
    expect(pre.status, JSON.stringify(j)).toBe(200);
    const res = await fetch(`${d.address}/v1/${a.chat ? 'chat/completions' : 'completions'}`, {
      method: 'POST',
      body: JSON.stringify({ ...body(a), kv_transfer_params: j.kv_transfer_params }),
    });
    return readAnswer(res, a);
  }

  it('/v1/models and /health name the model', async () => {
    const m = (await (await fetch(`${decode.address}/v1/models`)).json()) as { data: Array<{ id: string }> };
    expect(m.data.map((x) => x.id)).toEqual([TINY.name]);
    expect(decode.modelId).toBe(TINY.name);
  });

  it('greedy with stop strings, and long prompts: the same as one process', async () => {
    const long = 'a river runs through the valley and '.repeat(40);
    const cases: Ask[] = [
      { chat: false, text: 'Hello there', stop: ['a', 'e'], maxTokens: 32 },
      { chat: false, text: 'the cat sat on', stop: ['ll', 'kc'], maxTokens: 32, stream: true },
      { chat: false, text: long, maxTokens: 16 },
      { chat: false, text: 'one', maxTokens: 1 },
      ...Array.from({ length: 30 }, (_, i) => ({ chat: false, text: long.slice(0, 40 + i * 37), maxTokens: 24 })),
    ];
    for (const a of cases) {
      const g = await disaggregated(prefill, decode, a);
      expect(g.status, JSON.stringify(g.error)).toBe(200);
      expect(g.text, JSON.stringify(a)).toBe(await reference(a));
      if (a.stop && !a.stream) {
        for (const s of a.stop) expect(g.text).not.toContain(s);
        if (g.usage!.completion_tokens < a.maxTokens!) expect(g.finish).toBe('stop');
      }
    }
  }, 180_000);

  it('seeded sampling: the same seed gives the same text, another seed another', async () => {
    for (const chat of [false, true]) {
      const b = { chat, text: 'Once upon a time', temperature: 0.9, maxTokens: 24 };
      const a1 = await disaggregated(prefill, decode, { ...b, seed: 7 });
      const a2 = await disaggregated(prefill, decode, { ...b, seed: 7 });
      const a3 = await disaggregated(prefill, decode, { ...b, seed: 8 });
      expect(a1.status).toBe(200);
      expect(a2.text).toBe(a1.text);
      expect(a3.text).not.toBe(a1.text);
    }
  }, 120_000);

  it("a decode asked to sample otherwise than its prefill does not take the prefill's first token", async () => {
    const a: Ask = { chat: false, text: 'the first token was greedy', maxTokens: 8 };
    const pre = await fetch(`${prefill.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ ...body(a), max_tokens: 1, kv_transfer_params: { do_remote_decode: true } }),
    });
    const { kv_transfer_params } = (await pre.json()) as { kv_transfer_params: unknown };
    const res = await fetch(`${decode.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ ...body({ ...a, temperature: 0.9, seed: 5 }), kv_transfer_params }),
    });
    const g = await readAnswer(res, a);
    expect(g.status, JSON.stringify(g.error)).toBe(200);
    // The state's prompt is used, its last token evaluated again to sample from.
    expect(g.info?.kv_continued).toBe(false);
    expect(Number(g.info?.tokens_evaluated)).toBeGreaterThanOrEqual(1);
    expect(g.usage?.completion_tokens).toBeGreaterThan(0);
  }, 60_000);

  it.each(['truncate', 'corrupt', 'oversize', 'foreign'] as const)(
    'a %s state is refused before llama.cpp loads it; the decode stays up and serves the next request',
    async (how) => {
      const bad = await startWorker({ ...workerOptions, model: gguf, testHooks: { tamperKv: how } });
      closers.push(() => bad.close());
      const a: Ask = { chat: false, text: 'the quiet hills and rivers under rain '.repeat(6) };
      // The same prompt's honest state first: the decode's state buffer and file hold it when the bad one comes.
      expect((await disaggregated(prefill, decode, a)).text).toBe(await reference(a));
      const proto = nlc.LlamaContextSequence.prototype;
      const load = proto.loadStateFromFile;
      let loads = 0;
      proto.loadStateFromFile = function (this: Nlc.LlamaContextSequence, ...args: Parameters<typeof load>) {
        loads++;
        return load.apply(this, args);
      };
      const before = { ...decode.stats };
      try {
        const g = await disaggregated(bad, decode, a);
        expect(loads).toBe(0);
        expect(g.status).toBe(502);
        expect(g.error?.type).toBe('kv_rejected');
        const reason = { truncate: 'truncated', corrupt: 'corrupted', oversize: 'oversized', foreign: 'foreign-model' }[
          how
        ];
        expect(g.error?.message).toContain(`(${reason})`);
        expect(decode.stats.rejectedKv).toBe(before.rejectedKv + 1);
        expect(decode.stats.decodes).toBe(before.decodes);
        const ok = await disaggregated(prefill, decode, a);
        expect(ok.status).toBe(200);
        expect(ok.text).toBe(await reference(a));
        expect(loads).toBe(1);
      } finally {
        proto.loadStateFromFile = load;
      }
    },
    60_000,
  );

  it("another model's prefill is refused at the handshake: nothing read, the decode stays up", async () => {
    const other = path.join(dir, 'other.gguf');
    writeGguf(other, { ...TINY, name: 'other', seed: 99 });
    const foreign = await startWorker({ ...workerOptions, model: other });
    closers.push(() => foreign.close());
    const a: Ask = { chat: false, text: 'hello from another model' };
    const g = await disaggregated(foreign, decode, a);
    expect(g.status).toBe(400);
    expect(g.error?.message).toMatch(/compatibility hash/);
    expect((await disaggregated(prefill, decode, a)).text).toBe(await reference(a));
  }, 60_000);

  it("a prompt that cannot fit with the decode's max_tokens is refused by the prefill before it evaluates anything", async () => {
    const before = { ...prefill.stats };
    const r = await fetch(`${prefill.address}/v1/completions`, {
      method: 'POST',
      headers: { 'x-nixl-node-decode-max-tokens': String(prefill.model.contextSize) },
      body: JSON.stringify({ prompt: 'hello there', max_tokens: 1, kv_transfer_params: { do_remote_decode: true } }),
    });
    expect(r.status).toBe(400);
    expect(((await r.json()) as { error: { message: string } }).error.message).toMatch(
      new RegExp(`context holds ${prefill.model.contextSize} tokens`),
    );
    expect(prefill.stats.prefills).toBe(before.prefills);
    expect(prefill.freeBlocks).toBe(workerOptions.blocks);
    const health = (await (await fetch(`${prefill.address}/health`)).json()) as { max_model_len?: number };
    expect(health.max_model_len).toBe(prefill.model.contextSize);
  }, 60_000);

  it('requests it cannot serve are 4xx naming why', async () => {
    const post = async (p: string, b: unknown) => {
      const r = await fetch(`${decode.address}${p}`, { method: 'POST', body: JSON.stringify(b) });
      return { status: r.status, body: (await r.json()) as { error: { message: string } } };
    };
    const image = await post('/v1/chat/completions', {
      messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }],
      kv_transfer_params: { do_remote_decode: true },
    });
    expect(image.status).toBe(400);
    expect(image.body.error.message).toMatch(/text only/);
    const lastNotUser = await post('/v1/chat/completions', { messages: [{ role: 'assistant', content: 'hi' }] });
    expect(lastNotUser.status).toBe(400);
    const tooLong = await post('/v1/completions', {
      prompt: 'x'.repeat(5000),
      kv_transfer_params: { do_remote_decode: true },
    });
    expect(tooLong.status).toBeGreaterThanOrEqual(400);
    expect(tooLong.status).toBeLessThan(500);
  }, 60_000);
});

it('the built-in models are llama GGUFs node-llama-cpp loads; the small one has MiBs of KV for a long prompt', async () => {
  expect(Object.keys(BUILTIN)).toEqual(['tiny', 'small', 'tiny-utf8', 'tiny-unbiased']);
  const llama = await nlc.getLlama({ gpu: false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
  const small = await llama.loadModel({ modelPath: modelPath('small', dir) });
  try {
    const ctx = await small.createContext({ contextSize: 2048, threads: 2 });
    const seq = ctx.getSequence();
    await seq.evaluateWithoutGeneratingNewTokens(small.tokenize('word '.repeat(300)));
    const file = path.join(dir, 'small.state');
    await seq.saveStateToFile(file);
    expect(fs.statSync(file).size).toBeGreaterThan(4 << 20);
    await ctx.dispose();
  } finally {
    await small.dispose();
  }
}, 120_000);

it('startProxy fronts llama workers with the proxy unchanged (co-located: one worker in both pools)', async () => {
  const w = await startWorker({ ...workerOptions, model: gguf });
  const proxy = await startProxy({ prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });
  try {
    const a: Ask = { chat: false, text: 'one worker does both' };
    const g = await ask(proxy.url, a);
    expect(g.status).toBe(200);
    expect(g.info?.kv_moved).toBe(false);
    expect(g.text).toBe(await reference(a));
  } finally {
    await proxy.close();
    await w.close();
  }
}, 60_000);

it('a model file that is missing, not a GGUF or cut short: a typed error, nothing started', async () => {
  const junk = path.join(dir, 'junk.gguf');
  fs.writeFileSync(junk, Buffer.alloc(100_000, 7));
  const cut = path.join(dir, 'cut.gguf');
  fs.writeFileSync(cut, fs.readFileSync(gguf).subarray(0, 50_000));
  for (const model of [path.join(dir, 'none.gguf'), junk, cut, dir])
    await expect(startWorker({ model })).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
}, 60_000);

it("vLLM v0.13's wire profile carries a real model's KV too", async () => {
  const o = { ...workerOptions, model: gguf, wire: 'v0.13' as const };
  const p = await startWorker(o);
  const d = await startWorker(o);
  const proxy = await startProxy({ prefill: [p.address], decode: [d.address], healthIntervalMs: 0, wire: 'v0.13' });
  try {
    for (const a of [
      { chat: false, text: 'an older wire, the same answer' },
      { chat: true, text: 'and for chat' },
    ]) {
      const g = await ask(proxy.url, a);
      expect(g.status, JSON.stringify(g.error)).toBe(200);
      expect(g.info?.kv_moved).toBe(true);
      expect(g.text).toBe(await reference(a));
    }
  } finally {
    await proxy.close();
    await p.close();
    await d.close();
  }
}, 60_000);
