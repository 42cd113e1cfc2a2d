// GGUF push between workers that are not alike (docs/kv-push.md), each leg
// sent as a hostile or mistaken proxy would: another model, another context
// size (a long completion is cut to another length): no pair loads what it
// cannot prove. And push workers started with bidirectional KV, which push
// does not carry (vLLM refuses the pair): refused at start, so a push decode
// never spends time making a turn nobody can read.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { OneProcess } from '../../demo/llama-reference';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { modelPath } from '../../lib/serving/models/test-models';
import { pushDecodeParams } from '../../lib/serving/proxy/handoff-push';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-push-mixed-'));
// biome-ignore lint/suspicious/noExplicitAny: answers read as JSON
type Json = Record<string, any>;

const cleanup: Array<() => unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

async function worker(model: string, o: Record<string, unknown> = {}): Promise<Worker> {
  const w = await startWorker({
    model: modelPath(model, dir),
    contextSize: 1024,
    threads: 1,
    parallel: 1,
    blockBytes: 4096,
    blocks: 256,
    kvMode: 'push',
    ...o,
  });
  cleanup.push(() => w.close());
  return w;
}

/** A push decode leg's params, from the prefill's health info (as the push proxy builds them). */
function decodeParams(prefill: Worker, transferId: string) {
  const info = prefill.healthInfo() as Json;
  return pushDecodeParams(
    { engineId: prefill.name, host: info.kv_host, port: info.kv_port, tpSize: 1, ppSize: 1 },
    transferId,
  );
}

async function through(prefill: Worker, decode: Worker, body: Json) {
  const proxy = await startProxy({
    prefill: [prefill.address],
    decode: [decode.address],
    healthIntervalMs: 0,
    kvMode: 'push',
    timeoutMs: { prefill: 20_000, decode: 20_000 },
  });
  cleanup.push(() => proxy.close());
  const route = body.messages ? 'chat/completions' : 'completions';
  const r = await fetch(`${proxy.url}/v1/${route}`, { method: 'POST', body: JSON.stringify(body) });
  return { status: r.status, json: (await r.json()) as Json };
}

describe('GGUF push between unlike workers', () => {
  let ref: OneProcess;
  beforeAll(async () => {
    ref = await OneProcess.load(modelPath('tiny', dir), { contextSize: 1024, threads: 1 });
  }, 60_000);
  afterAll(async () => ref?.close());

  it('a push worker with bidirectional KV is refused at start (push never reads a held turn), typed, before the model loads', async () => {
    // A decode would otherwise evaluate and save each answered turn again for a next prefill that never comes.
    await expect(worker('tiny', { bidirectionalKv: true })).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_SUPPORTED' });
    await expect(worker('tiny', { bidirectionalKv: true, model: '/nonexistent.gguf' })).rejects.toMatchObject({
      code: 'NIXL_ERR_NOT_SUPPORTED',
    });
    // Push workers as they are answer as node-llama-cpp alone.
    const prefill = await worker('tiny');
    const decode = await worker('tiny');
    const messages = [{ role: 'user', content: 'Tell me a short story about a dragon and a knight.' }];
    const a = await through(prefill, decode, { messages, max_tokens: 8, temperature: 0 });
    expect(a.status, JSON.stringify(a.json)).toBe(200);
    expect(a.json.nixl_node.kv_mode).toBe('push');
    expect(a.json.choices[0].message.content).toBe(
      (await ref.generate({ chat: true, text: messages[0].content, maxTokens: 8 })).text,
    );
  }, 120_000);

  /** One push transfer sent leg by leg, as the push proxy sends it (no proxy to refuse the pair first). */
  async function legs(prefill: Worker, decode: Worker, body: Json) {
    const id = `xfer-${Math.random().toString(16).slice(2)}`;
    const route = body.messages ? 'chat/completions' : 'completions';
    const send = async (w: Worker, kv: Json) => {
      const r = await fetch(`${w.address}/v1/${route}`, {
        method: 'POST',
        body: JSON.stringify({ ...body, kv_transfer_params: kv }),
      });
      return { status: r.status, json: (await r.json()) as Json };
    };
    const d = send(decode, decodeParams(prefill, id));
    const p = await send(prefill, { do_remote_decode: true, transfer_mode: 'push', transfer_id: id });
    return { prefill: p, decode: await d };
  }

  it('another model on the decode, sent leg by leg: refused typed, nothing loaded', async () => {
    const prefill = await worker('tiny');
    const decode = await worker('tiny-utf8');
    const a = await legs(prefill, decode, { prompt: 'the cat sat on the mat', max_tokens: 4, temperature: 0 });
    expect(a.decode.status, JSON.stringify(a.decode.json)).toBeGreaterThanOrEqual(400);
    expect(a.decode.json.error.code ?? a.decode.json.error.type).toBeDefined();
    expect(decode.stats.decodes).toBe(0);
  }, 120_000);

  it('another context size, a completion the smaller one cuts, sent leg by leg: refused typed, nothing loaded', async () => {
    // The prefill's context leaves room for 231 prompt tokens, the decode's for 461: they evaluate other tokens.
    const prefill = await worker('tiny', { contextSize: 256 });
    const decode = await worker('tiny', { contextSize: 512 });
    let prompt = '';
    const tokens = () =>
      prefill.model.promptTokenIds!({ chat: false, prompt, messages: [], maxTokens: 4, temperature: 0, stop: [] })
        .length;
    while (tokens() < 215) prompt += 'rain fell over hills ';
    while (tokens() < 240) prompt += ' x';
    expect(tokens()).toBeLessThan(252);
    const a = await legs(prefill, decode, { prompt, max_tokens: 4, temperature: 0 });
    expect(a.decode.status, JSON.stringify(a.decode.json)).toBeGreaterThanOrEqual(400);
    expect(a.decode.json.error.type).toMatch(/^kv_/);
    expect(decode.stats.decodes).toBe(0);
  }, 120_000);

  it('a decode closed after registering: the prefill frees its blocks (no WRITE retried), then serves the next pair', async () => {
    const prefill = await worker('tiny', { leaseMs: 3000 });
    const decode = await worker('tiny');
    const body = { prompt: 'the cat sat on the mat and looked at the rain', max_tokens: 4, temperature: 0 };
    const id = 'xfer-closed-decode';
    const d = fetch(`${decode.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        ...body,
        kv_transfer_params: decodeParams(prefill, id),
      }),
    }).catch((e: unknown) => e);
    // Its blocks are taken (registered, or about to be), then it goes.
    await expect.poll(() => decode.freeBlocks).toBeLessThan(256);
    await decode.close();
    await d;
    const p = await fetch(`${prefill.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        ...body,
        kv_transfer_params: { do_remote_decode: true, transfer_mode: 'push', transfer_id: id },
      }),
    });
    expect(p.status).toBe(200);
    await expect.poll(() => prefill.freeBlocks, { timeout: 15_000 }).toBe(256);
    expect(prefill.stats.freedByRead).toBe(0);
    // The prefill serves a fresh decode as before.
    const other = await worker('tiny');
    const a = await legs(prefill, other, body);
    expect(a.decode.status, JSON.stringify(a.decode.json)).toBe(200);
    expect(a.decode.json.choices[0].text).toBe(
      (await ref.generate({ chat: false, text: body.prompt, maxTokens: 4 })).text,
    );
  }, 120_000);
});
