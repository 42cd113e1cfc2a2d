// A GGUF decode given KV states it must not trust, through a real pull from a
// prefill that writes them (the tamperKv hook: the prefill's own envelope,
// changed and sealed again, as a broken or hostile prefill, or anyone when
// there is no KV secret, can). Each is a 502 kv_rejected naming the reason
// and its NixlError code, llama.cpp never sees the bytes (the worker process
// lives), and the next honest request gets the answer it got before.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { type Worker, startWorker } from '../../lib/serving';
import { ENVELOPE_FIELDS, resealEnvelope } from '../../lib/serving/models/kv-state';
import { type Reply, at, chat, completion, disaggregated, options, post } from '../llama-kv-helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-hostile-'));

describe('a GGUF decode refuses KV states it cannot vouch for (no KV secret)', () => {
  let gguf: string;
  let prefill: Worker;
  let decode: Worker;
  let mutate: ((env: Buffer) => Buffer) | undefined;
  const honest: Record<string, string> = {};
  const asks = { completion: completion('the cat sat on the mat and'), chat: chat('tell me about rivers') };

  beforeAll(async () => {
    gguf = modelPath('tiny', dir);
    prefill = await startWorker({
      ...options,
      model: gguf,
      testHooks: { tamperKv: (env) => (mutate ? mutate(env) : env) },
    });
    decode = await startWorker({ ...options, model: gguf });
    for (const [k, b] of Object.entries(asks)) {
      const g = await disaggregated(prefill, decode, b);
      expect(g.status, JSON.stringify(g.error)).toBe(200);
      honest[k] = g.text;
    }
  }, 60_000);
  afterAll(async () => {
    await prefill?.close();
    await decode?.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  /** The answer to `kind` when the prefill's envelope goes through `m` on its way (this request only). */
  async function tampered(kind: keyof typeof asks, m: (env: Buffer) => Buffer): Promise<Reply> {
    mutate = m;
    try {
      return await disaggregated(prefill, decode, asks[kind]);
    } finally {
      mutate = undefined;
    }
  }

  /** A state changed by `f` and sealed again is refused as `why`; then both honest asks are served as before. */
  async function refused(kind: keyof typeof asks, f: (env: Buffer) => void, why: string, code: string) {
    const g = await tampered(kind, (env) => {
      f(env);
      resealEnvelope(env);
      return env;
    });
    expect(g.status, JSON.stringify(g)).toBe(502);
    expect(g.error?.type).toBe('kv_rejected');
    expect(g.error?.reason).toBe(why);
    expect(g.error?.nixl_code).toBe(code);
    for (const [k, b] of Object.entries(asks)) {
      const ok = await disaggregated(prefill, decode, b);
      expect(ok.status, JSON.stringify(ok.error)).toBe(200);
      expect(ok.text).toBe(honest[k]);
    }
    const h = await fetch(`${decode.address}/health`);
    expect(h.status).toBe(200);
  }

  it('an out-of-vocabulary first token (greedy completion)', async () => {
    await refused(
      'completion',
      (env) => env.writeUInt32LE(100_000 + 1, ENVELOPE_FIELDS.nextToken),
      'malformed',
      'NIXL_ERR_INVALID_PARAM',
    );
  }, 30_000);

  it("an out-of-vocabulary token in the state's token list (chat)", async () => {
    await refused(
      'chat',
      (env) => env.writeUInt32LE(100_000, at.token(at.tokens(env) - 1)),
      'malformed',
      'NIXL_ERR_INVALID_PARAM',
    );
  }, 30_000);

  it('a state one byte short', async () => {
    await refused(
      'completion',
      (env) => env.writeBigUInt64LE(BigInt(at.stateBytes(env) - 1), 16),
      'truncated',
      'NIXL_ERR_INVALID_PARAM',
    );
  }, 30_000);

  it('a position of 2^31-1: refused, and later requests are not poisoned', async () => {
    await refused(
      'completion',
      (env) => env.writeInt32LE(0x7fffffff, at.position(env, at.tokens(env) - 1)),
      'malformed',
      'NIXL_ERR_INVALID_PARAM',
    );
  }, 30_000);

  it('a cell count of 2^31: refused before anything is allocated for it', async () => {
    const rss = process.memoryUsage.rss();
    await refused(
      'completion',
      (env) => env.writeUInt32LE(2 ** 31, at.cellCount(env)),
      'oversized',
      'NIXL_ERR_INVALID_PARAM',
    );
    expect(process.memoryUsage.rss() - rss).toBeLessThan(512 << 20);
  }, 30_000);

  it("forged block ids with the client's own held id: refused, the victim's KV not read into an answer", async () => {
    const victim = await post(prefill.address, { ...asks.chat, kv_transfer_params: { do_remote_decode: true } });
    expect(victim.status).toBe(200);
    const g = await disaggregated(prefill, decode, completion('what did the other user ask?'), (own) => ({
      ...own,
      remote_block_ids: victim.params!.remote_block_ids,
    }));
    expect(g.status, JSON.stringify(g)).toBe(502);
    expect(g.error?.reason).toBe('wrong-request');
    expect(g.error?.nixl_code).toBe('NIXL_ERR_MISMATCH');
    // The victim's own decode still gets its answer.
    const v = await post(decode.address, { ...asks.chat, kv_transfer_params: victim.params });
    expect(v.status, JSON.stringify(v.error)).toBe(200);
    expect(v.text).toBe(honest.chat);
  }, 30_000);

  /** A state changed by `f` and not sealed again (damage on the way) is refused as corrupted (the XXH64 checksum). */
  async function damaged(kind: keyof typeof asks, f: (env: Buffer) => void) {
    const g = await tampered(kind, (env) => {
      expect(env.readUInt32LE(8)).toBe(2); // sealed with XXH64
      f(env);
      return env;
    });
    expect(g.status, JSON.stringify(g)).toBe(502);
    expect(g.error?.reason).toBe('corrupted');
    expect(g.error?.nixl_code).toBe('NIXL_ERR_MISMATCH');
    const ok = await disaggregated(prefill, decode, asks[kind]);
    expect(ok.status, JSON.stringify(ok.error)).toBe(200);
    expect(ok.text).toBe(honest[kind]);
  }

  it('damage the checksum catches: one bit of the state, the last byte, a header field, the checksum and its 0 tail, flags relabelled SHA-256', async () => {
    await damaged('completion', (env) => {
      env[at.token(0) + 2] ^= 0x01;
    });
    await damaged('chat', (env) => {
      env[env.length - 1] ^= 0x80;
    });
    await damaged('completion', (env) => {
      env[ENVELOPE_FIELDS.nextToken] ^= 0x04;
    });
    await damaged('chat', (env) => {
      env[224] ^= 0x01;
    });
    await damaged('completion', (env) => {
      env[255] = 1;
    });
    await damaged('chat', (env) => env.writeUInt32LE(0, 8));
  }, 60_000);

  it("an earlier prefill's SHA-256 envelope (flags 0) is still served, with the honest answer", async () => {
    for (const kind of ['completion', 'chat'] as const) {
      const g = await tampered(kind, (env) => {
        env.writeUInt32LE(0, 8);
        resealEnvelope(env);
        return env;
      });
      expect(g.status, JSON.stringify(g.error)).toBe(200);
      expect(g.text).toBe(honest[kind]);
    }
  }, 60_000);

  it('an envelope of another version', async () => {
    await refused('completion', (env) => env.writeUInt16LE(1, 4), 'version', 'NIXL_ERR_NOT_SUPPORTED');
  }, 30_000);
});

describe('with a KV secret', () => {
  it('a state changed and sealed by anyone without the secret is refused as unauthenticated; honest ones served', async () => {
    const gguf = modelPath('tiny', dir);
    let mutate: ((env: Buffer) => Buffer) | undefined;
    const o = { ...options, model: gguf, kvSecret: 'deployment secret' };
    const prefill = await startWorker({ ...o, testHooks: { tamperKv: (env) => (mutate ? mutate(env) : env) } });
    const decode = await startWorker(o);
    const plain = await startWorker({ ...options, model: gguf });
    try {
      const b = completion('a quiet river');
      const ok = await disaggregated(prefill, decode, b);
      expect(ok.status, JSON.stringify(ok.error)).toBe(200);
      mutate = (env) => {
        env.writeUInt32LE(3, at.token(1));
        resealEnvelope(env); // a checksum anyone can compute: not the HMAC
        return env;
      };
      const g = await disaggregated(prefill, decode, b);
      expect(g.status).toBe(502);
      expect(g.error?.reason).toBe('unauthenticated');
      expect(g.error?.nixl_code).toBe('NIXL_ERR_NOT_ALLOWED');
      mutate = undefined;
      // A decode without the secret cannot check an authenticated state: refused, named.
      const noSecret = await disaggregated(prefill, plain, b, (p) => {
        const { nixl_node_signature: _, ...rest } = p;
        return rest;
      });
      expect(noSecret.status).toBe(502);
      expect(noSecret.error?.reason).toBe('unauthenticated');
      const again = await disaggregated(prefill, decode, b);
      expect(again.status).toBe(200);
      expect(again.text).toBe(ok.text);
    } finally {
      await prefill.close();
      await decode.close();
      await plain.close();
    }
  }, 60_000);
});
