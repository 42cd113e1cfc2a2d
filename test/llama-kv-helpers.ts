// What the tests of a GGUF decode given hostile KV states share: requests,
// a prefill-then-decode round trip, offsets inside an envelope.
import { expect } from 'vitest';
import type { Worker } from '../lib/serving';
import { HEADER_BYTES } from '../lib/serving/models/kv-state';

const H = HEADER_BYTES;
/** Worker options: a small context, one context each (a poisoned one would be reused). */
export const options = { contextSize: 256, threads: 1, parallel: 1, blockBytes: 4096, blocks: 256 };

export interface Reply {
  status: number;
  text: string;
  error?: { message: string; type: string; reason?: string; nixl_code?: string };
  params?: Record<string, unknown>;
}

export const completion = (prompt: string) => ({ prompt, max_tokens: 6, temperature: 0 });
export const chat = (content: string) => ({ messages: [{ role: 'user', content }], max_tokens: 6, temperature: 0 });

export async function post(url: string, body: Record<string, unknown>): Promise<Reply> {
  const route = body.messages ? 'chat/completions' : 'completions';
  const r = await fetch(`${url}/v1/${route}`, { method: 'POST', body: JSON.stringify(body) });
  const j = (await r.json()) as {
    choices?: Array<{ text?: string; message?: { content: string } }>;
    error?: Reply['error'];
    kv_transfer_params?: Record<string, unknown>;
  };
  const c = j.choices?.[0];
  return { status: r.status, text: c?.text ?? c?.message?.content ?? '', error: j.error, params: j.kv_transfer_params };
}

/** Prefill on p, then decode on d with the params p returned (changed by `edit`). */
export async function disaggregated(
  p: Worker,
  d: Worker,
  body: Record<string, unknown>,
  edit: (params: Record<string, unknown>) => Record<string, unknown> = (x) => x,
): Promise<Reply> {
  const pre = await post(p.address, { ...body, kv_transfer_params: { do_remote_decode: true } });
  expect(pre.status, JSON.stringify(pre.error)).toBe(200);
  return post(d.address, { ...body, kv_transfer_params: edit(pre.params!) });
}

/** Offsets inside an envelope (header, then llama.cpp's state). */
export const at = {
  stateBytes: (env: Buffer) => Number(env.readBigUInt64LE(16)),
  tokens: (env: Buffer) => env.readUInt32LE(H + 8),
  token: (i: number) => H + 12 + 4 * i,
  cellCount: (env: Buffer) => H + 16 + 4 * at.tokens(env),
  position: (env: Buffer, i: number) => H + 20 + 4 * at.tokens(env) + 12 * i,
};
