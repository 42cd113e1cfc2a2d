// A GGUF worker moves every state through buffers and load files it uses
// again (models/llama/state-buffers.ts, state-file.ts). Nothing of one
// request may reach another's KV: requests at once on three contexts (big
// and small states, more than a kept buffer holds), damaged states among
// honest ones, clients that leave, a load llama.cpp fails. Every honest
// answer is node-llama-cpp's alone for its prompt, every damaged state a
// 502, and what the worker keeps stays bounded (buffers all given back,
// files no more than its contexts).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { type Ask, OneProcess } from '../../demo/llama-reference';
import { type Worker, startWorker } from '../../lib/serving';
import { resealEnvelope } from '../../lib/serving/models/kv-state';
import { StateBuffers } from '../../lib/serving/models/llama/state-buffers';
import { loadNodeLlamaCpp } from '../../lib/serving/models/node-llama-cpp';
import { modelPath } from '../../lib/serving/models/test-models';
import { type Reply, at, disaggregated, post } from '../llama-kv-helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-state-reuse-'));
const CTX = { contextSize: 4096, threads: 1 };
// The decode has fewer contexts than requests come at once: decodes wait for one with their states in hand.
const PARALLEL = 2;
const MAX = 12;

// Buffers lent and not given back, per StateBuffers (every worker's model in this process).
const out = new Map<StateBuffers, number>();
const proto = StateBuffers.prototype;
const take = proto.take;
const give = proto.give;

let ref: OneProcess;
let nlc: typeof Nlc;
let prefill: Worker;
let bad: Worker;
let decode: Worker;
const closers: Array<() => unknown> = [];

// Prompts from 20 to 4000 tokens (the test models' tokens are bytes, a space
// three): states from a few KiB to more than 1 MiB, the grain buffers are kept in.
const words = 'the quiet hills and rivers under rain, a lantern by the door. ';
const ASKS: Ask[] = [
  { chat: false, text: 'a small bird sang', maxTokens: MAX },
  { chat: true, text: 'tell me about rivers and the sea', maxTokens: MAX },
  { chat: false, text: words.repeat(5), maxTokens: MAX },
  { chat: false, text: `once ${words.repeat(30)}`, maxTokens: MAX },
  // No spaces (each is three byte tokens): 4000 tokens, a state of more than 1 MiB.
  { chat: false, text: `twice,${'quiet.hills,and.rivers,under.rain;'.repeat(117)}`, maxTokens: MAX },
];
const expected: string[] = [];

const body = (a: Ask) =>
  a.chat
    ? { messages: [{ role: 'user', content: a.text }], max_tokens: a.maxTokens, temperature: 0 }
    : { prompt: a.text, max_tokens: a.maxTokens, temperature: 0 };

// The damaging prefill's ways, in turn: every one must be refused, whatever the decode's buffers held before.
let damage = 0;
const DAMAGES: Array<(env: Buffer) => Buffer> = [
  (env) => {
    env[env.length - 7] ^= 0x01; // one bit of the last layer's KV: the checksum
    return env;
  },
  (env) => {
    // A shorter state, sealed again: smaller than the buffer that held an honest one (its tail is stale).
    env.writeBigUInt64LE(BigInt(Math.floor(at.stateBytes(env) / 2)), 16);
    resealEnvelope(env);
    return env;
  },
  (env) => {
    env.writeBigUInt64LE(1n << 40n, 16);
    resealEnvelope(env);
    return env;
  },
  (env) => {
    // Its token count one more than the envelope says: the state's own parse.
    env.writeUInt32LE(at.tokens(env) + 1, at.tokens(env) === 0 ? 0 : 256 + 8);
    resealEnvelope(env);
    return env;
  },
];

beforeAll(async () => {
  proto.take = function (this: StateBuffers, bytes: number) {
    out.set(this, (out.get(this) ?? 0) + 1);
    return take.call(this, bytes);
  };
  proto.give = function (this: StateBuffers, b: Buffer) {
    const before = this.lent;
    give.call(this, b);
    if (this.lent < before) out.set(this, (out.get(this) ?? 0) - 1);
  };
  const gguf = modelPath('tiny', dir);
  nlc = await loadNodeLlamaCpp();
  ref = await OneProcess.load(gguf, CTX);
  for (const a of ASKS) expected.push((await ref.generate(a)).text);
  const o = { model: gguf, ...CTX, parallel: PARALLEL, blockBytes: 16384, blocks: 512 };
  prefill = await startWorker({ ...o, parallel: 3, stateDir: path.join(dir, 'p') });
  closers.push(() => prefill.close());
  bad = await startWorker({
    ...o,
    stateDir: path.join(dir, 'b'),
    testHooks: { tamperKv: (env) => DAMAGES[damage++ % DAMAGES.length](env) },
  });
  closers.push(() => bad.close());
  decode = await startWorker({ ...o, stateDir: path.join(dir, 'd') });
  closers.push(() => decode.close());
}, 180_000);

afterAll(async () => {
  proto.take = take;
  proto.give = give;
  for (const c of closers.reverse()) await c();
  await ref?.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

for (const d of ['p', 'b', 'd']) fs.mkdirSync(path.join(dir, d), { recursive: true });

/** Files in a worker's state directories now. */
const stateFiles = (d: string) =>
  fs
    .readdirSync(path.join(dir, d))
    .flatMap((sub) => fs.readdirSync(path.join(dir, d, sub)).map((f) => path.join(dir, d, sub, f)));

async function settled(): Promise<void> {
  // Saved files are removed off the request's path: give them a moment.
  for (let i = 0; i < 50 && stateFiles('p').length + stateFiles('b').length > 0; i++)
    await new Promise((r) => setTimeout(r, 20));
}

function honestOk(g: Reply, i: number, what: string): void {
  expect(g.status, `${what}: ${JSON.stringify(g.error)}`).toBe(200);
  expect(g.text, `${what}: ask ${i}`).toBe(expected[i]);
}

it("honest and damaged states at once, more than the decode's contexts: each honest answer is its own, each damaged one a 502", async () => {
  for (let round = 0; round < 2; round++) {
    const honest = ASKS.map((a, i) => disaggregated(prefill, decode, body(a)).then((g) => honestOk(g, i, 'honest')));
    const damaged = ASKS.map((a) =>
      disaggregated(bad, decode, body(a)).then((g) => {
        expect(g.status, JSON.stringify(g)).toBe(502);
        expect(g.error?.type).toBe('kv_rejected');
      }),
    );
    await Promise.all([...honest, ...damaged]);
  }
  await settled();
  expect(out.size).toBeGreaterThanOrEqual(3); // every worker's buffers were counted
  for (const [b, n] of out) expect(n, `buffers of ${b.keep} not given back`).toBe(0);
  // The load slots: no more than the decode's contexts; saved states: none left.
  expect(stateFiles('d').length).toBeLessThanOrEqual(PARALLEL);
  expect(stateFiles('p')).toEqual([]);
  expect(stateFiles('b')).toEqual([]);
}, 300_000);

it('clients that leave at any time and a load llama.cpp fails: the next answers are their own, nothing kept grows', async () => {
  const load = nlc.LlamaContextSequence.prototype.loadStateFromFile;
  let fail = 1;
  nlc.LlamaContextSequence.prototype.loadStateFromFile = function (
    this: Nlc.LlamaContextSequence,
    ...args: Parameters<typeof load>
  ) {
    if (fail-- > 0) return Promise.reject(new Error('injected load failure'));
    return load.apply(this, args);
  };
  try {
    const failed = await disaggregated(prefill, decode, body(ASKS[3]));
    expect(failed.status, JSON.stringify(failed)).toBe(502);
    expect(failed.error?.message).toMatch(/refused/);
    // Clients leave the decode after 0 to 40 ms: while it pulls, loads or generates.
    for (let round = 0; round < 2; round++) {
      await Promise.all(
        ASKS.map(async (a, i) => {
          const pre = await post(prefill.address, { ...body(a), kv_transfer_params: { do_remote_decode: true } });
          const ac = new AbortController();
          setTimeout(() => ac.abort(), (i * 10 + round * 5) % 40);
          await fetch(`${decode.address}/v1/${a.chat ? 'chat/' : ''}completions`, {
            method: 'POST',
            body: JSON.stringify({ ...body(a), kv_transfer_params: pre.params }),
            signal: ac.signal,
          })
            .then((r) => r.text())
            .catch(() => undefined);
        }),
      );
      const answers = await Promise.all(ASKS.map((a) => disaggregated(prefill, decode, body(a))));
      for (const [i, g] of answers.entries()) honestOk(g, i, `after clients left (round ${round})`);
    }
  } finally {
    nlc.LlamaContextSequence.prototype.loadStateFromFile = load;
  }
  await settled();
  expect(stateFiles('d').length).toBeLessThanOrEqual(PARALLEL);
  expect(stateFiles('p')).toEqual([]);
}, 300_000);
