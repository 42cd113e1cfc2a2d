// GGUF workers in push mode (docs/kv-push.md): the decode computes from its
// own prompt how many blocks the prefill's llama.cpp state will take,
// registers exactly those, and the prefill WRITEs its state into them. Push
// answers equal pull answers and node-llama-cpp alone in one process (HTTP
// and ZeroMQ, through `proxy --kv-mode push`); a decode and a prefill whose
// states differ in size are refused by the prefill (nothing written), in
// tokens by the decode (nothing loaded); a hostile registration of another
// block count is refused without a byte written.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { type Ask as RefAsk, OneProcess, askBody } from '../../demo/llama-reference';
import { NixlAgent } from '../../lib/agent';
import { DescList, allocate } from '../../lib/descriptors';
import { servePrefill } from '../../lib/kv/prefill';
import { KvPushReceiver } from '../../lib/kv/push/decode';
import type { KvLayout } from '../../lib/kv/layout';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import type { LlamaModel } from '../../lib/serving/models/llama';
import { modelPath } from '../../lib/serving/models/test-models';
import type { GenerationRequest } from '../../lib/serving/models/types';
import { pushDecodeParams } from '../../lib/serving/proxy/handoff-push';
import { pushHash } from '../../lib/serving/worker/handoff-push';

const CTX = { contextSize: 2048, threads: 1 };
const MAX_TOKENS = 10;
const BLOCKS = 256;
const BLOCK_BYTES = 4096;
const SYSTEM = [{ role: 'system', content: 'You answer briefly.' }];
let ref: OneProcess;
let gguf: string;
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-push-'));

beforeAll(async () => {
  gguf = modelPath('tiny', dir);
  ref = await OneProcess.load(gguf, CTX);
}, 60_000);
afterAll(async () => {
  await ref?.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

const cleanup: Array<() => unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

type Ask = { chat: boolean; text: string; stream?: boolean };
// biome-ignore lint/suspicious/noExplicitAny: answers read as JSON
type Json = Record<string, any>;

/** Completions and chat, ASCII and not (2- to 4-byte characters: more tokens than characters), streamed or not. */
const ASKS: Ask[] = [
  { chat: false, text: 'the cat sat on a warm mat' },
  { chat: false, text: 'Grüße aus Köln, 你好世界 🌍 — naïve café', stream: true },
  { chat: true, text: 'Ça va? Привет, как дела? こんにちは' },
  { chat: false, text: 'rain fell over quiet hills and rivers '.repeat(12) },
  { chat: true, text: 'tell me about rivers', stream: true },
  // Past the room node-llama-cpp leaves for generation (a tenth of the context): LlamaCompletion cuts it.
  { chat: false, text: `${'ab, '.repeat(10)}${'z'.repeat(1880)}` },
];

const full = (a: Ask): RefAsk => ({ ...a, maxTokens: MAX_TOKENS, history: a.chat ? SYSTEM : undefined });

async function ask(
  url: string,
  a: Ask,
): Promise<{ status: number; text: string; info?: Json; usage?: Json; error?: Json }> {
  const res = await fetch(`${url}/v1/${a.chat ? 'chat/completions' : 'completions'}`, {
    method: 'POST',
    body: JSON.stringify(askBody(full(a), a.stream ?? false)),
  });
  if (!a.stream || res.status !== 200) {
    const j = (await res.json()) as Json;
    const c = j.choices?.[0];
    return {
      status: res.status,
      text: (a.chat ? c?.message?.content : c?.text) ?? '',
      info: j.nixl_node,
      usage: j.usage,
      error: j.error,
    };
  }
  let text = '';
  let info: Json | undefined;
  for (const line of (await res.text()).split('\n')) {
    if (!line.startsWith('data: {')) continue;
    const c = JSON.parse(line.slice(6));
    text += (a.chat ? c.choices[0]?.delta?.content : c.choices[0]?.text) ?? '';
    info = c.nixl_node ?? info;
  }
  return { status: 200, text, info };
}

function options(kvMode: 'pull' | 'push', o: Record<string, unknown> = {}) {
  return { model: gguf, ...CTX, parallel: 2, blockBytes: BLOCK_BYTES, blocks: BLOCKS, kvMode, ...o };
}

async function cluster(transport: 'http' | 'zmq', kvMode: 'pull' | 'push') {
  const prefill = await startWorker({ name: `P-${kvMode}-${transport}`, transport, ...options(kvMode) });
  cleanup.push(() => prefill.close());
  const decode = await startWorker({ name: `D-${kvMode}-${transport}`, transport, ...options(kvMode) });
  cleanup.push(() => decode.close());
  const proxy = await startProxy({
    transport,
    prefill: [prefill.address],
    decode: [decode.address],
    healthIntervalMs: 0,
    kvMode,
    timeoutMs: { prefill: 20_000, decode: 20_000 },
  });
  cleanup.push(() => proxy.close());
  return { prefill, decode, proxy };
}

/** Two push workers and no proxy: the test sends each leg itself. */
async function pair(o: Record<string, unknown> = {}) {
  const prefill = await startWorker({ name: `P-${Math.random()}`, ...options('push', o) });
  cleanup.push(() => prefill.close());
  const decode = await startWorker({ name: `D-${Math.random()}`, ...options('push', o) });
  cleanup.push(() => decode.close());
  return { prefill, decode };
}

function request(text: string): GenerationRequest {
  return { chat: false, prompt: text, messages: [], maxTokens: 1, temperature: 0, stop: [] };
}

/** The push legs of one transfer, as the push proxy sends them. */
function legs(prefill: Worker, transferId: string) {
  const info = prefill.healthInfo() as Json;
  return {
    prefill: { do_remote_decode: true, transfer_mode: 'push', transfer_id: transferId },
    decode: pushDecodeParams(
      { engineId: prefill.name, host: info.kv_host, port: info.kv_port, tpSize: 1, ppSize: 1 },
      transferId,
    ),
  };
}

async function post(w: Worker, prompt: string, kv: Json, maxTokens = 4) {
  const r = await fetch(`${w.address}/v1/completions`, {
    method: 'POST',
    body: JSON.stringify({ prompt, max_tokens: maxTokens, temperature: 0, kv_transfer_params: kv }),
  });
  return { status: r.status, json: (await r.json()) as Json };
}

describe.each(['http', 'zmq'] as const)('GGUF push through the proxy (%s)', (transport) => {
  it('push answers equal pull answers and node-llama-cpp alone, with kv_mode push', async () => {
    const want: string[] = [];
    for (const a of ASKS) want.push((await ref.generate(full(a))).text);
    expect(want.every((t) => t.length > 0)).toBe(true);
    for (const mode of ['pull', 'push'] as const) {
      const c = await cluster(transport, mode);
      for (const [i, a] of ASKS.entries()) {
        const g = await ask(c.proxy.url, a);
        expect(g.status, JSON.stringify(g.error)).toBe(200);
        expect(g.text, `${mode} prompt ${i}`).toBe(want[i]);
        expect(g.info).toMatchObject({ kv_moved: true, kv_mode: mode });
        // The decode generated from the KV it was given: every prompt token loaded, only the last evaluated again.
        expect(Number(g.info?.kv_tokens_loaded)).toBeGreaterThan(1);
        expect(Number(g.info?.tokens_evaluated)).toBeLessThanOrEqual(MAX_TOKENS + 1);
        if (!a.stream) expect(g.usage?.prompt_tokens).toBe(g.info?.kv_tokens_loaded);
      }
      expect(c.decode.stats.decodes).toBe(ASKS.length);
      expect(c.decode.stats.rejectedKv).toBe(0);
      // Every hold went back: the push prefill's once written, the decode's once loaded.
      await expect.poll(() => c.prefill.freeBlocks, { timeout: 10_000 }).toBe(BLOCKS);
      await expect.poll(() => c.decode.freeBlocks, { timeout: 10_000 }).toBe(BLOCKS);
      if (mode === 'push') {
        expect(c.prefill.stats.freedByRead).toBe(ASKS.length);
        expect(c.prefill.stats.failedPushes).toBe(0);
      }
      for (const f of cleanup.splice(0).reverse()) await f();
    }
  });
});

describe('GGUF push, token ids in and out', () => {
  it('POST /inference/v1/generate through the push proxy: the ids spell what node-llama-cpp generates alone', async () => {
    const c = await cluster('http', 'push');
    for (const text of ['the cat sat on a warm mat', 'Grüße, 你好 🌍']) {
      const want = (await ref.generate({ chat: false, text, maxTokens: 8 })).text;
      // As LlamaCompletion tokenizes a prompt after its BOS.
      const ids = Array.from(ref.model.tokenize(text, false, 'trimLeadingSpace'));
      const r = await fetch(`${c.proxy.url}/inference/v1/generate`, {
        method: 'POST',
        body: JSON.stringify({ token_ids: ids, sampling_params: { max_tokens: 8, temperature: 0 } }),
      });
      const j = (await r.json()) as Json;
      expect(r.status, JSON.stringify(j)).toBe(200);
      expect(ref.model.detokenize(j.choices[0].token_ids)).toBe(want);
      expect(j.nixl_node).toMatchObject({ kv_mode: 'push', kv_moved: true });
    }
    expect(c.decode.stats.decodes).toBe(2);
  });
});

describe('GGUF push refusals', () => {
  it('a chat past the room node-llama-cpp leaves (it would drop history): both legs answer 400, nothing computed', async () => {
    const c = await cluster('http', 'push');
    const long: Ask = { chat: true, text: 'q'.repeat(1880) };
    const g = await ask(c.proxy.url, long);
    expect(g.status, JSON.stringify(g.error)).toBe(400);
    expect(g.error?.message).toMatch(/must fit whole/);
    // The prefill leg alone: the same 400, before evaluating anything.
    const r = await fetch(`${c.prefill.address}/v1/chat/completions`, {
      method: 'POST',
      body: JSON.stringify({
        ...askBody(full(long), false),
        kv_transfer_params: legs(c.prefill, 'xfer-long-chat').prefill,
      }),
    });
    expect(r.status).toBe(400);
    expect(c.prefill.stats.prefillEvaluatedTokens).toBe(0);
    // Short enough: answered.
    expect((await ask(c.proxy.url, { chat: true, text: 'q'.repeat(100) })).status).toBe(200);
  });

  it('prompts whose states differ in size: the prefill writes nothing and refuses, the decode fails typed at once, nothing loaded', async () => {
    // A deadline and a lease far away: only the refusal can end the decode's wait, only the failure free the blocks.
    const { prefill, decode } = await pair({ pushTimeoutMs: 60_000, leaseMs: 60_000 });
    const short = 'a short prompt';
    const long = `${short} that one leg was given, longer by far than the other's`;
    const model = prefill.model as LlamaModel;
    expect(model.pushBlocksFor(request(long))).toBeGreaterThan(model.pushBlocksFor(request(short)));
    // The decode's state smaller (it would take a truncated one) and larger (a padded one).
    for (const [i, [pre, dec]] of [
      [long, short],
      [short, long],
    ].entries()) {
      const kv = legs(prefill, `xfer-size-mismatch-${i}`);
      const [p, d] = await Promise.all([post(prefill, pre, kv.prefill), post(decode, dec, kv.decode)]);
      expect(p.status, JSON.stringify(p.json)).toBe(200);
      expect(d.status, JSON.stringify(d.json)).toBe(502);
      expect(d.json.error.type).toBe('kv_push_refused');
      expect(d.json.error.message).toMatch(/registered \d+ blocks/);
      // Refused before any WRITE: the prefill's blocks are back long before its lease; the decode loaded nothing.
      await expect.poll(() => prefill.stats.failedPushes, { timeout: 5000 }).toBe(i + 1);
      await expect.poll(() => prefill.freeBlocks, { timeout: 2000 }).toBe(BLOCKS);
    }
    expect(prefill.stats.freedByRead).toBe(0);
    expect(decode.stats.decodes).toBe(0);
    expect(decode.stats.rejectedKv).toBe(0);
    expect(decode.stats.kvLoadMs).toBe(0);
  });

  it('prompts of the same size but other tokens: written, then refused by the decode (wrong-request), nothing loaded', async () => {
    const { prefill, decode } = await pair({ pushTimeoutMs: 10_000 });
    const kv = legs(prefill, 'xfer-token-mismatch');
    const [p, d] = await Promise.all([
      post(prefill, 'the prefill was given this', kv.prefill),
      post(decode, 'the decode was given these', kv.decode),
    ]);
    expect(p.status, JSON.stringify(p.json)).toBe(200);
    expect(d.status, JSON.stringify(d.json)).toBe(502);
    expect(d.json.error.type).toBe('kv_rejected');
    expect(d.json.error.reason).toBe('wrong-request');
    expect(decode.stats.rejectedKv).toBe(1);
    expect(decode.stats.decodes).toBe(0);
    expect(prefill.stats.freedByRead).toBe(1);
    // The same legs with the same prompt: answered (the refusal above was the prompt's, not the setup's).
    const ok = legs(prefill, 'xfer-token-match');
    const [p2, d2] = await Promise.all([
      post(prefill, 'the decode was given these', ok.prefill),
      post(decode, 'the decode was given these', ok.decode),
    ]);
    expect(p2.status).toBe(200);
    expect(d2.status, JSON.stringify(d2.json)).toBe(200);
    expect(d2.json.nixl_node).toMatchObject({ kv_mode: 'push', kv_moved: true });
  });

  it('with a KV secret on both: registrations signed, the state sealed with an HMAC, answered; another secret: nothing written', async () => {
    const { prefill, decode } = await pair({ kvSecret: 'deployment secret', pushTimeoutMs: 1500 });
    const kv = legs(prefill, 'xfer-secret');
    const prompt = 'sealed with the secret';
    const [p, d] = await Promise.all([post(prefill, prompt, kv.prefill), post(decode, prompt, kv.decode)]);
    expect(p.status, JSON.stringify(p.json)).toBe(200);
    expect(d.status, JSON.stringify(d.json)).toBe(200);
    expect(d.json.nixl_node).toMatchObject({ kv_mode: 'push', kv_moved: true });
    // A decode of another secret: its registration is refused unread, it waits out its deadline, nothing loaded.
    const other = await startWorker({
      name: `D-other-${Math.random()}`,
      ...options('push', { kvSecret: 'another', pushTimeoutMs: 1500 }),
    });
    cleanup.push(() => other.close());
    const kv2 = legs(prefill, 'xfer-other-secret');
    const [p2, d2] = await Promise.all([post(prefill, prompt, kv2.prefill), post(other, prompt, kv2.decode)]);
    expect(p2.status).toBe(200);
    expect(d2.status, JSON.stringify(d2.json)).toBe(504);
    expect(d2.json.error.type).toBe('kv_push_timeout');
    expect(other.stats.decodes).toBe(0);
  });

  it('hostile: a registration of one block fewer or more is refused, no byte written; the exact count is written', async () => {
    const { prefill } = await pair({ leaseMs: 20_000 });
    const model = prefill.model as LlamaModel;
    // A decode of the same geometry as the workers' that registers what it likes.
    const agent = new NixlAgent('hostile-decode');
    cleanup.push(() => agent.close());
    const mem = allocate(BLOCKS * BLOCK_BYTES).fill(0x5a);
    agent.registerMemory(mem);
    const layout: KvLayout = {
      engineId: 'hostile-decode',
      tpSize: 1,
      tpRank: 0,
      numBlocks: BLOCKS,
      blockSize: 16,
      blockLens: [BLOCK_BYTES],
      baseAddrs: [DescList.from(mem).addr(0)],
      kvCacheLayout: 'LBHNC',
      totalNumKvHeads: 8,
    };
    const hash = pushHash(model.compatibilityHash);
    const side = await servePrefill({
      ranks: [{ agent, layout }],
      compatibilityHash: hash,
      port: 0,
      logger: { warn() {} },
    });
    cleanup.push(() => side.close());
    const receiver = new KvPushReceiver({
      agent,
      layout,
      decodeHost: '127.0.0.1',
      decodePort: side.basePort,
      expectedHash: hash,
      kvLeaseMs: 500,
      quarantineMs: 1,
    });
    cleanup.push(() => receiver.close());
    const prompt = 'a prompt whose state takes a few blocks of four KiB each, '.repeat(3);
    const exact = model.pushBlocksFor(request(prompt));
    expect(exact).toBeGreaterThan(2);
    let block = 0;
    for (const [i, n] of [exact - 1, exact + 1, exact].entries()) {
      const transferId = `xfer-hostile-${i}`;
      const kv = legs(prefill, transferId);
      const ids = Array.from({ length: n }, () => block++);
      const got = receiver.receive(kv.decode, {
        requestId: `${transferId}-0badcafe`,
        localBlockIds: ids,
        timeoutMs: 30_000,
      });
      got.catch(() => undefined);
      const p = await post(prefill, prompt, kv.prefill);
      expect(p.status, JSON.stringify(p.json)).toBe(200);
      const region = mem.subarray(ids[0] * BLOCK_BYTES, (ids[ids.length - 1] + 1) * BLOCK_BYTES);
      if (n !== exact) {
        await expect(got).rejects.toMatchObject({ kind: 'refused', code: 'NIXL_ERR_MISMATCH' });
        expect(
          region.every((x) => x === 0x5a),
          `${n} blocks registered: written into`,
        ).toBe(true);
        expect(prefill.stats.failedPushes).toBe(i + 1);
      } else {
        await expect(got).resolves.toMatchObject({ notifications: 1 });
        expect(region.subarray(0, 4).toString('latin1')).toBe('NNKV');
      }
    }
    await expect.poll(() => prefill.freeBlocks, { timeout: 2000 }).toBe(BLOCKS);
    expect(prefill.stats.freedByRead).toBe(1);
  });
});
