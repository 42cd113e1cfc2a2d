// A worker that publishes KV events: its config is checked before anything
// starts, its /health and etcd record say where its events are, vLLM's
// /tokenize and /detokenize give a router the ids its events carry, and a
// GGUF worker announces exactly the whole batches its contexts can reuse:
// a prompt's reused tokens equal the announced blocks it starts with.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { type Worker, startWorker } from '../../lib/serving';
import { parseRecord } from '../../lib/serving/fleet/record';
import { blockDigests, noneHash, wireHash } from '../../lib/serving/worker/kv-events/block-hash';
import { chatPrompt } from '../../lib/serving/models/synthetic-kv';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-kv-events-w-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));
const on = (name: string, more: Record<string, unknown> = {}) => ({
  enable_kv_cache_events: true,
  endpoint: `ipc://${dir}/${name}-pub`,
  ...more,
});

async function post(w: Worker, p: string, body: unknown): Promise<{ status: number; body: Record<string, unknown> }> {
  const r = await fetch(`${w.address}${p}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: r.status, body: (await r.json()) as Record<string, unknown> };
}

describe('worker options', () => {
  it('refuses a bad --kv-events-config before anything starts', async () => {
    for (const kvEvents of ['{', '{"enable_kv_cache_events":true,"buffer_steps":-1}', { nope: 1 }])
      await expect(startWorker({ kvEvents: kvEvents as never })).rejects.toMatchObject({
        code: 'NIXL_ERR_INVALID_PARAM',
      });
  });

  it('publishes nothing unless enabled (vLLM null publisher)', async () => {
    const w = await startWorker({ kvEvents: { endpoint: `ipc://${dir}/off` } });
    try {
      expect(w.kvEvents).toBeUndefined();
      expect(
        ((await (await fetch(`${w.address}/health`)).json()) as Record<string, unknown>).kv_events,
      ).toBeUndefined();
    } finally {
      await w.close();
    }
  });

  it('an endpoint that cannot be bound is a clear error', async () => {
    await expect(
      startWorker({ kvEvents: on('x', { endpoint: `ipc://${dir}/no/such/dir/pub` }) }),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_BACKEND' });
  });
});

describe('replay endpoint', () => {
  it('ignores malformed requests and answers the next good one, topic frame included', async () => {
    const zmq = await import('zeromq');
    const w = await startWorker({ kvEvents: on('rp', { replay_endpoint: `ipc://${dir}/rp-replay`, topic: 'tp' }) });
    const d = new zmq.Dealer({ receiveTimeout: 5000, linger: 0 });
    try {
      d.connect(`ipc://${dir}/rp-replay`);
      const start = Buffer.alloc(8);
      for (const bad of [
        [Buffer.alloc(0), Buffer.from('abc')],
        [Buffer.from('x'), start],
        [Buffer.alloc(0), start, start],
      ])
        await d.send(bad);
      await d.send([Buffer.alloc(0), start]);
      const first = await d.receive();
      expect(first.map((f) => f.toString('hex')).slice(0, 3)).toEqual([
        '',
        Buffer.from('tp').toString('hex'),
        '0'.repeat(16),
      ]);
      const end = await d.receive();
      expect(end.map((f) => f.toString('hex'))).toEqual(['', '', 'f'.repeat(16), '']);
      expect(w.kvEvents!.publisher.stats).toMatchObject({ replays: 1, badReplays: 3 });
    } finally {
      d.close();
      await w.close();
    }
  });
});

describe('etcd record', () => {
  const base = {
    v: 1,
    name: 'w',
    role: 'both',
    model: 'm',
    address: 'http://127.0.0.1:1',
    transport: 'http',
    freeBlocks: 1,
    totalBlocks: 2,
    load: 0,
  };
  it('carries kv_events, and a malformed one makes the record unreadable', () => {
    const kv = { endpoint: 'tcp://10.0.0.7:5556', replay_endpoint: 'tcp://10.0.0.7:5557', topic: 't', block_size: 16 };
    expect(parseRecord(JSON.stringify({ ...base, kv_events: kv }))).toEqual({ ...base, kv_events: kv });
    expect(parseRecord(JSON.stringify(base))).toEqual(base);
    for (const bad of [1, { ...kv, endpoint: 'http://x' }, { ...kv, replay_endpoint: 5 }, { ...kv, block_size: 0 }])
      expect(typeof parseRecord(JSON.stringify({ ...base, kv_events: bad }))).toBe('string');
  });
});

describe('synthetic worker: /tokenize, /detokenize', () => {
  it("answers vLLM's shapes with the ids its events carry", async () => {
    const w = await startWorker({ kvEvents: on('tok', { topic: 'kv@x@m' }) });
    try {
      const prompt = 'héllo tokens '.repeat(4);
      const t = await post(w, '/tokenize', { model: w.modelId, prompt });
      expect(t).toEqual({
        status: 200,
        body: { count: Buffer.byteLength(prompt), max_model_len: null, tokens: [...Buffer.from(prompt)] },
      });
      expect((await post(w, '/tokenize', { prompt, add_special_tokens: false })).body.tokens).toEqual(t.body.tokens);
      const messages = [{ role: 'user', content: 'hi there' }];
      expect((await post(w, '/tokenize', { messages })).body.tokens).toEqual([...Buffer.from(chatPrompt(messages))]);
      expect(await post(w, '/detokenize', { tokens: t.body.tokens })).toEqual({ status: 200, body: { prompt } });
      // The blocks a request caches are the chain of those ids.
      expect((await post(w, '/v1/completions', { prompt, max_tokens: 1 })).status).toBe(200);
      const want = blockDigests(t.body.tokens as number[], 16, noneHash()).map(wireHash);
      expect(w.kvEvents!.announced().sort()).toEqual(want.sort());
      const again = await post(w, '/v1/completions', { prompt, max_tokens: 1 });
      expect((again.body.nixl_node as Record<string, unknown>).prefix_reused_tokens).toBe(want.length * 16);
      // A reset forgets the cache and says so: nothing announced, nothing reused.
      w.kvEvents!.reset();
      expect(w.kvEvents!.announced()).toEqual([]);
      const after = await post(w, '/v1/completions', { prompt, max_tokens: 1 });
      expect((after.body.nixl_node as Record<string, unknown>).prefix_reused_tokens).toBe(0);
      expect(w.kvEvents!.announced().sort()).toEqual(want.sort());
    } finally {
      await w.close();
    }
  });

  it('refuses bad bodies with 4xx, and other methods with 405', async () => {
    const w = await startWorker({ kvEvents: on('tok-bad') });
    try {
      for (const body of [
        {},
        { prompt: 1 },
        { prompt: 'a', messages: [] },
        { messages: 'x' },
        { prompt: 'a', add_special_tokens: 'yes' },
        { messages: [], add_generation_prompt: false },
        { prompt: 'a', return_token_strs: true },
      ])
        expect((await post(w, '/tokenize', body)).status, JSON.stringify(body)).toBe(400);
      expect((await post(w, '/tokenize', { model: 'other', prompt: 'a' })).status).toBe(404);
      for (const tokens of [[256], [-1], [1.5], 'ab', undefined])
        expect((await post(w, '/detokenize', { tokens })).status).toBe(400);
      expect((await fetch(`${w.address}/tokenize`)).status).toBe(405);
    } finally {
      await w.close();
    }
  });
});

describe('GGUF worker: announces the whole batches its contexts keep', () => {
  it('what a prompt reuses is exactly the announced blocks it starts with', async () => {
    const { modelPath } = await import('../../lib/serving/models/test-models');
    const w = await startWorker({
      model: modelPath('tiny'),
      contextSize: 1024,
      threads: 1,
      parallel: 1,
      batchSize: 32,
      kvEvents: on('gguf'),
    });
    try {
      const health = (await (await fetch(`${w.address}/health`)).json()) as Record<string, unknown>;
      expect(health.kv_events).toMatchObject({ block_size: 32, replay_endpoint: null, topic: '' });
      const base = 'You are a careful assistant. Answer in one short sentence, and be exact. '.repeat(3);
      const digests = async (prompt: string) =>
        blockDigests((await post(w, '/tokenize', { prompt })).body.tokens as number[], 32, noneHash()).map(wireHash);
      const held = () => new Set(w.kvEvents!.announced());
      const leading = (ds: bigint[]) => {
        const h = held();
        let n = 0;
        while (n < ds.length && h.has(ds[n])) n++;
        return n;
      };
      const p1 = `${base}What is 2 + 2?`;
      const r1 = await post(w, '/v1/completions', { prompt: p1, max_tokens: 2 });
      expect(r1.status).toBe(200);
      const d1 = await digests(p1);
      expect(w.kvEvents!.announced().length).toBeGreaterThan(0);
      expect(leading(d1)).toBe(held().size); // all of them are p1's prefix blocks
      const reusedSeen: number[] = [];
      for (const p2 of [`${base}What is 3 + 5?`, 'Something else entirely, with nothing in common at all.'.repeat(2)]) {
        const expected = leading(await digests(p2)) * 32;
        reusedSeen.push(expected);
        const r2 = await post(w, '/v1/completions', { prompt: p2, max_tokens: 2 });
        expect((r2.body.nixl_node as Record<string, unknown>).prefix_reused_tokens, p2).toBe(expected);
        // One context: it now announces p2's blocks only, the rest removed.
        expect(leading(await digests(p2))).toBe(held().size);
      }
      expect(reusedSeen[0]).toBeGreaterThanOrEqual(64); // the shared base: whole batches of it
      expect(reusedSeen[1]).toBe(0);
    } finally {
      await w.close();
    }
  }, 120_000);
});
