// Push beside pull through the proxy (docs/kv-push.md), with the synthetic
// model or a GGUF (the generated 'small' llama; its KV moves as llama.cpp's
// sequence state, sized by the push decode from the prompt's tokens): the
// same prompts through a pull cluster (prefill, then decode; the decode
// READs) and a push cluster (both legs at once; the prefill WRITEs into the
// decode's registered blocks), request by request alternating so both see
// the same machine. Reported per prompt size and transport: time to first
// token (median, range, ratio to pull), the KV's move time as the decode saw
// it (pull: its READ; push: registration to the last WRITE) and its GB/s, and
// whether both modes answered the same text. Each engine compiled in gets
// its rows (the workers' agents run on it; the proxy moves no KV).
import * as os from 'node:os';
import type { EngineKind } from '../lib';
import { startProxy, startWorker, type ServingProxy, type WorkerOptions } from '../lib/serving';
import { median } from './stats';

export interface PushRow {
  /** 'synthetic', or the GGUF's name. */
  model: string;
  engine: EngineKind;
  transport: 'http' | 'zmq';
  mode: 'pull' | 'push';
  /** Tokens of the prompt (GGUF: as the decode loaded them, BOS included). */
  promptTokens: number;
  kvBytes: number;
  ttftMs: number;
  ttftMin: number;
  ttftMax: number;
  /** TTFT / pull's TTFT (medians). */
  ttftRatio: number;
  moveMs: number;
  kvGBps: number;
  /** Requests whose answer equals pull's. */
  identical: number;
  requests: number;
}

interface Sample {
  ms: number;
  text: string;
  info: Record<string, number>;
}

async function firstToken(url: string, prompt: string): Promise<Sample> {
  const t0 = performance.now();
  const r = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt, max_tokens: 8, temperature: 0, stream: true }),
  });
  if (!r.ok || !r.body) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
  let ms = 0;
  let text = '';
  let info: Record<string, number> = {};
  let buf = '';
  const dec = new TextDecoder();
  for await (const part of r.body) {
    buf += dec.decode(part as Uint8Array, { stream: true });
    let at = buf.indexOf('\n\n');
    while (at >= 0) {
      const line = buf.slice(0, at);
      buf = buf.slice(at + 2);
      at = buf.indexOf('\n\n');
      if (!line.startsWith('data: {')) continue;
      const c = JSON.parse(line.slice(6));
      if (c.error) throw new Error(c.error.message);
      const piece = c.choices?.[0]?.text ?? '';
      if (piece && !ms) ms = performance.now() - t0;
      text += piece;
      if (c.nixl_node) info = c.nixl_node;
    }
  }
  return { ms, text, info };
}

async function cluster(
  engine: EngineKind,
  transport: 'http' | 'zmq',
  kvMode: 'pull' | 'push',
  closers: Array<() => Promise<unknown>>,
  gguf?: string,
) {
  // Push exists only in vLLM's v12 wire; both clusters speak it whatever NIXL_WIRE says, so the rows compare.
  const o: WorkerOptions = { engine, transport, kvMode, blocks: 2048, wire: 'v12' };
  // One request at a time per worker, but push runs both legs at once: each
  // worker's llama.cpp gets half the cores, or the two spin against each
  // other (TTFT ranged 10x within a row on a loaded machine).
  const threads = Math.max(1, Math.floor(os.availableParallelism() / 2));
  if (gguf) Object.assign(o, { model: gguf, contextSize: 2048, parallel: 1, threads, blocks: 512 });
  const [p, d] = await Promise.all([startWorker(o), startWorker(o)]);
  closers.push(
    () => p.close(),
    () => d.close(),
  );
  const proxy: ServingProxy = await startProxy({
    transport,
    kvMode,
    wire: 'v12',
    prefill: [p.address],
    decode: [d.address],
    healthIntervalMs: 0,
  });
  closers.unshift(() => proxy.close());
  return proxy.url;
}

/** `gguf`: a GGUF file the workers load (default: the synthetic model). */
export async function benchPush(
  engines: EngineKind[],
  requests: number,
  promptTokens: number[],
  gguf?: string,
): Promise<PushRow[]> {
  const rows: PushRow[] = [];
  const closers: Array<() => Promise<unknown>> = [];
  try {
    for (const engine of engines)
      for (const transport of ['http', 'zmq'] as const) {
        const url = {
          pull: await cluster(engine, transport, 'pull', closers, gguf),
          push: await cluster(engine, transport, 'push', closers, gguf),
        };
        for (const n of promptTokens) {
          const got = { pull: [] as Sample[], push: [] as Sample[] };
          let identical = 0;
          for (let i = 0; i <= requests; i++) {
            const prompt = `${i} ${'abcdefghij'.repeat(Math.ceil(n / 10))}`.slice(0, n);
            const a = await firstToken(url.pull, prompt);
            const b = await firstToken(url.push, prompt);
            if (i === 0) continue; // warm-up: handshakes, first registrations
            got.pull.push(a);
            got.push.push(b);
            if (a.text === b.text) identical++;
          }
          const pullTtft = median(got.pull.map((s) => s.ms));
          for (const mode of ['pull', 'push'] as const) {
            const s = got[mode];
            const ttft = s.map((x) => x.ms);
            const move = s.map((x) => x.info.kv_pull_ms ?? x.info.kv_push_ms ?? 0);
            const bytes = s[0]?.info.kv_bytes ?? 0;
            rows.push({
              model: gguf ? (gguf.split('/').pop() ?? gguf).replace(/\.gguf$/i, '') : 'synthetic',
              engine,
              transport,
              mode,
              promptTokens: s[0]?.info.kv_tokens_loaded ?? n,
              kvBytes: bytes,
              ttftMs: median(ttft),
              ttftMin: Math.min(...ttft),
              ttftMax: Math.max(...ttft),
              ttftRatio: median(ttft) / pullTtft,
              moveMs: median(move),
              kvGBps: bytes / (median(move) * 1e6),
              identical: mode === 'pull' ? s.length : identical,
              requests: s.length,
            });
          }
        }
      }
    return rows;
  } finally {
    for (const c of closers) await c();
  }
}
