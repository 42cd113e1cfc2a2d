// Bidirectional KV (vLLM #32553) on the synthetic model: a decode that ends a
// turn holds the conversation's KV and returns kv_transfer_params naming it;
// the next turn's prefill reads what is provably its prompt's prefix, and the
// decode of that turn checks every byte of the whole prompt's KV. Anything
// that does not prove to be the prompt's prefix is recomputed, never read.
import { afterEach, describe, expect, it } from 'vitest';
import { type Worker, startWorker } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import { signKvTransferParams } from '../../lib/kv/params-auth';

const closers: Array<() => unknown> = [];
afterEach(async () => {
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
async function pair(o: { secret?: string; ttlMs?: number; wire?: 'v12' | 'v0.13'; threshold?: number } = {}) {
  const common = { bidirectionalKv: true, kvSecret: o.secret, wire: o.wire, kvRecomputeThreshold: o.threshold };
  const p = await startWorker({ name: `MP-${Math.random()}`, ...common });
  const d = await startWorker({ name: `MD-${Math.random()}`, decoderKvTtlMs: o.ttlMs, ...common });
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
