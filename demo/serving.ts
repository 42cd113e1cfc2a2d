// npm run demo -- --serving: the proxy and its workers as real processes
// (nixl-node proxy / worker), N concurrent client requests through the
// proxy. With the synthetic model, every answer is checked against what the
// model says for its prompt and every KV byte by the decode worker that
// pulled it; with a GGUF (--model), every answer against node-llama-cpp
// generating alone in this process.
import { type ChildProcess, spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { MODEL_NAME, expectedCompletion } from '../lib/serving/models/synthetic-kv';
import { modelPath } from '../lib/serving/models/test-models';
import { type Ask, OneProcess, askBody } from './llama-reference';
import { loadNodeLlamaCpp } from '../lib/serving/models/node-llama-cpp';

/** What the serving demo runs (cli/demo.ts parses them from the command line). */
export interface ServingDemoOptions {
  /** Concurrent client requests. */
  requests: number;
  transport: 'http' | 'zmq';
  /** Prefill workers. */
  prefill: number;
  /** Decode workers. */
  decode: number;
  maxTokens: number;
  /** A GGUF, or the name of a generated test model (tiny, small); default the synthetic model. */
  model?: string;
  /** With a model: CPU threads of each worker context and of the reference. */
  threads: number;
  /** The last line is a JSON summary. */
  json: boolean;
}

/** Worker context size with --model (the reference uses the same). */
const CONTEXT_SIZE = 2048;

interface Proc {
  p: ChildProcess;
  ready: Record<string, unknown>;
  lines: Array<Record<string, unknown>>;
  /** For one that ended on its own: what ended it and its last stderr lines. */
  death(): string | undefined;
}

const BIN = path.join(__dirname, '..', '..', 'bin', 'nixl-node.js');

/** Why a child process ended, in words: its exit code, or the signal that killed it. */
export function exitReason(code: number | null, signal: NodeJS.Signals | null): string {
  return signal ? `was killed by ${signal}` : `exited with code ${code}`;
}

/** Starts a nixl-node command and resolves on its ready line (spawned: the child, at once). */
export function start(args: string[], spawned?: (p: ChildProcess) => void): Promise<Proc> {
  const p = spawn(process.execPath, [BIN, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  spawned?.(p);
  const lines: Array<Record<string, unknown>> = [];
  let err = '';
  p.stderr!.on('data', (d) => {
    err = (err + d).slice(-8192);
  });
  const lastLines = () => err.trim().split('\n').filter(Boolean).slice(-10).join(' | ');
  const death = () =>
    p.exitCode === null && p.signalCode === null
      ? undefined
      : `nixl-node ${args.slice(0, 3).join(' ')} ${exitReason(p.exitCode, p.signalCode)}${lastLines() ? `: ${lastLines()}` : ''}`;
  return new Promise((resolve, reject) => {
    readline.createInterface({ input: p.stdout! }).on('line', (l) => {
      let j: Record<string, unknown>;
      try {
        j = JSON.parse(l);
      } catch {
        return;
      }
      lines.push(j);
      if (j.ready) resolve({ p, ready: j, lines, death });
    });
    // 'close': after its stderr is read, so its last lines are in the error.
    p.once('close', (c, sig) => {
      const last = lastLines();
      reject(
        new Error(
          `nixl-node ${args[0]} ${exitReason(c, sig)} before it was ready${last ? `: ${last}` : ' (no stderr)'}`,
        ),
      );
    });
  });
}

async function stop(x: Proc): Promise<Record<string, unknown> | undefined> {
  if (x.p.exitCode !== null) return undefined;
  const exited = new Promise((r) => x.p.once('exit', r));
  x.p.kill('SIGTERM');
  await exited;
  return x.lines.find((l) => l.stopped);
}

/** Prompts of different lengths (1 to 12 KV blocks of 16 tokens). */
function prompt(i: number): string {
  const words = 'the quick brown fox jumps over the lazy dog while a KV cache moves'.split(' ');
  const n = 3 + ((i * 37) % 45);
  return `request ${i}: ${Array.from({ length: n }, (_, k) => words[(i + k) % words.length]).join(' ')}`;
}

interface Outcome {
  ok: boolean;
  ms: number;
  bytes: number;
  error?: string;
}

/** An answer's text, streamed (SSE) or not, and the sum of one nixl_node field; a failure throws. */
async function readAnswer(
  r: Response,
  chat: boolean,
  stream: boolean,
  field: 'verified_bytes' | 'kv_bytes',
): Promise<{ text: string; bytes: number }> {
  let text = '';
  let bytes = 0;
  if (stream && r.ok) {
    for (const line of (await r.text()).split('\n')) {
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const c = JSON.parse(line.slice(6));
      if (c.error) throw new Error(c.error.message);
      text += (chat ? c.choices[0].delta.content : c.choices[0].text) ?? '';
      bytes += c.nixl_node?.[field] ?? 0;
    }
    return { text, bytes };
  }
  const j = (await r.json()) as {
    error?: { message?: string };
    choices: Array<{ text: string; message: { content: string } }>;
    nixl_node?: Record<string, number>;
  };
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${j.error?.message}`);
  return { text: chat ? j.choices[0].message.content : j.choices[0].text, bytes: j.nixl_node?.[field] ?? 0 };
}

async function oneRequest(url: string, i: number, maxTokens: number): Promise<Outcome> {
  const chat = i % 2 === 1;
  const stream = i % 4 >= 2;
  const text = prompt(i);
  const body = chat
    ? { model: MODEL_NAME, messages: [{ role: 'user', content: text }], max_tokens: maxTokens, stream }
    : { model: MODEL_NAME, prompt: text, max_tokens: maxTokens, stream };
  const want = expectedCompletion(chat ? `user: ${text}` : text, maxTokens).join(' ');
  const t0 = performance.now();
  try {
    const r = await fetch(`${url}${chat ? '/v1/chat/completions' : '/v1/completions'}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-request-id': `demo-${i}` },
      body: JSON.stringify(body),
    });
    const { text: got, bytes } = await readAnswer(r, chat, stream, 'verified_bytes');
    const ms = performance.now() - t0;
    if (got !== want) return { ok: false, ms, bytes: 0, error: `answer '${got}' != expected '${want}'` };
    if (r.headers.get('x-request-id') !== `demo-${i}`) return { ok: false, ms, bytes, error: 'x-request-id not kept' };
    return { ok: bytes > 0, ms, bytes, error: bytes > 0 ? undefined : 'no KV verified' };
  } catch (e) {
    return { ok: false, ms: performance.now() - t0, bytes: 0, error: (e as Error).message };
  }
}

/** A --model request: completions and chat, streamed and not, greedy. */
function ask(i: number, maxTokens: number): Ask {
  const text = prompt(i);
  return i % 2 === 1
    ? { chat: true, text, history: [{ role: 'system', content: 'You answer briefly.' }], maxTokens }
    : { chat: false, text, maxTokens };
}

async function oneModelRequest(url: string, i: number, maxTokens: number): Promise<Outcome & { text?: string }> {
  const a = ask(i, maxTokens);
  const stream = i % 4 >= 2;
  const t0 = performance.now();
  try {
    const r = await fetch(`${url}${a.chat ? '/v1/chat/completions' : '/v1/completions'}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-request-id': `demo-${i}` },
      body: JSON.stringify(askBody(a, stream)),
    });
    const { text, bytes } = await readAnswer(r, a.chat, stream, 'kv_bytes');
    const ms = performance.now() - t0;
    return { ok: bytes > 0, ms, bytes, text, error: bytes > 0 ? undefined : 'no KV moved' };
  } catch (e) {
    return { ok: false, ms: performance.now() - t0, bytes: 0, error: (e as Error).message };
  }
}

function blockRange(n: number): string {
  const blocks = Array.from({ length: n }, (_, i) => Math.ceil(Buffer.byteLength(prompt(i)) / 16));
  return `${Math.min(...blocks)}-${Math.max(...blocks)}`;
}

function pct(sorted: number[], p: number): number {
  return sorted.length === 0 ? 0 : sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

export async function runServingDemo(o: ServingDemoOptions): Promise<void> {
  const gguf = o.model === undefined ? undefined : modelPath(o.model);
  // Without node-llama-cpp: one line naming it, before any worker starts.
  if (gguf) await loadNodeLlamaCpp();
  const { threads, transport, maxTokens } = o;
  const modelArgs = gguf ? ['--model', gguf, '--threads', String(threads), '--context-size', String(CONTEXT_SIZE)] : [];
  const n = o.requests;
  const nP = o.prefill;
  const nD = o.decode;
  const log = (s: string) => {
    if (!o.json) console.log(s);
  };
  log(
    `nixl-node demo --serving: ${n} requests, proxy -> ${nP} prefill + ${nD} decode workers over ${transport}` +
      (gguf ? `, model ${path.basename(gguf)}` : ', synthetic model'),
  );
  const procs: Proc[] = [];
  try {
    const workers = await Promise.all(
      Array.from({ length: nP + nD }, (_, i) =>
        start([
          'worker',
          '--transport',
          transport,
          '--name',
          `${i < nP ? 'prefill' : 'decode'}-${i < nP ? i : i - nP}`,
          '--blocks',
          gguf ? '1024' : '2048',
          ...modelArgs,
        ]),
      ),
    );
    procs.push(...workers);
    const addrs = workers.map((w) => String(w.ready.address));
    const proxy = await start([
      'proxy',
      '--port',
      '0',
      '--transport',
      transport,
      '--prefill',
      addrs.slice(0, nP).join(','),
      '--decode',
      addrs.slice(nP).join(','),
      '--policy',
      'least-outstanding',
    ]);
    procs.push(proxy);
    const url = String(proxy.ready.url);
    log(`  proxy ${url}; workers ${addrs.join(', ')}`);
    const t0 = performance.now();
    const outcomes: Array<Outcome & { text?: string }> = await Promise.all(
      Array.from({ length: n }, (_, i) => (gguf ? oneModelRequest : oneRequest)(url, i, maxTokens)),
    );
    const wallMs = performance.now() - t0;
    // --model: each answer against node-llama-cpp alone (after the run, so as not to slow it).
    let identical: number | undefined;
    if (gguf) {
      const ref = await OneProcess.load(gguf, { contextSize: CONTEXT_SIZE, threads });
      identical = 0;
      try {
        for (const [i, o] of outcomes.entries()) {
          if (!o.ok) continue;
          const want = (await ref.generate(ask(i, maxTokens))).text;
          if (o.text === want) identical++;
          else
            Object.assign(o, {
              ok: false,
              error: `answer ${JSON.stringify(o.text)} != one process's ${JSON.stringify(want)}`,
            });
        }
      } finally {
        await ref.close();
      }
    }
    const ok = outcomes.filter((o) => o.ok);
    const lat = outcomes.map((o) => o.ms).sort((a, b) => a - b);
    const verifiedBytes = ok.reduce((a, o) => a + o.bytes, 0);
    // A worker or the proxy that died during the run is named, with why.
    const deaths = procs.map((x) => x.death()).filter((d): d is string => d !== undefined);
    const stats = await Promise.all(procs.map(stop));
    procs.length = 0;
    const wstats = stats.slice(0, nP + nD).map((s) => (s?.stats ?? {}) as Record<string, number>);
    const freed = wstats.slice(0, nP).reduce((a, s) => a + (s.freedByRead ?? 0), 0);
    const completed = outcomes.filter((o) => o.ok);
    const summary = {
      requests: n,
      completed: completed.length,
      failed: n - completed.length,
      ...(gguf ? { identical, kvBytes: verifiedBytes, model: path.basename(gguf) } : {}),
      verifiedBytes: gguf ? 0 : verifiedBytes,
      latencyMsP50: Number(pct(lat, 50).toFixed(1)),
      latencyMsP99: Number(pct(lat, 99).toFixed(1)),
      wallMs: Number(wallMs.toFixed(1)),
      requestsPerSecond: Number(((n / wallMs) * 1000).toFixed(1)),
      kvGBps: Number((verifiedBytes / wallMs / 1e6).toFixed(3)),
      transport,
      prefillWorkers: nP,
      decodeWorkers: nD,
      prefillFreedByRead: freed,
      errors: [...deaths, ...new Set(outcomes.filter((o) => !o.ok).map((o) => o.error))].slice(0, 5),
    };
    const rows: Array<[string, string]> = gguf
      ? [
          ['requests', `${n} (completions and chat, streamed and not, greedy, ${maxTokens} tokens each)`],
          ['completed', `${completed.length}, ${identical} identical to node-llama-cpp generating alone`],
          ['failed', String(n - completed.length)],
          ['KV moved', `${(verifiedBytes / 1048576).toFixed(2)} MiB pulled by the decodes (whole KV blocks)`],
        ]
      : [
          ['requests', `${n} (completions and chat, streamed and not, ${blockRange(n)} KV blocks of 16 tokens each)`],
          ['completed', `${ok.length}, every answer equal to the synthetic model's for its prompt`],
          ['failed', String(n - ok.length)],
          [
            'KV verified',
            `${(verifiedBytes / 1048576).toFixed(2)} MiB, every byte checked by the decode worker that pulled it`,
          ],
        ];
    rows.push(
      ['prefill freed', `${freed}/${n} requests' blocks after the decode read (the rest by lease)`],
      ['latency', `p50 ${summary.latencyMsP50} ms, p99 ${summary.latencyMsP99} ms (client to last byte)`],
      ['throughput', `${summary.requestsPerSecond} requests/s over ${summary.wallMs} ms wall`],
    );
    for (const [k, x] of rows) log(`  ${k.padEnd(14)} ${x}`);
    for (const e of summary.errors) log(`  error: ${e}`);
    if (o.json) console.log(JSON.stringify(summary));
    if (completed.length !== n || deaths.length > 0) process.exitCode = 1;
  } finally {
    await Promise.all(procs.map(stop));
  }
}
