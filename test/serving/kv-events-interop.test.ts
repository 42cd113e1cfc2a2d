// A worker's KV events against a consumer of our own in Python
// (fixtures/kv_events_peer.py: pyzmq + msgpack, written from the spec of
// vLLM's events and llm-d's rules, no nixl-node code): what the peer's index
// holds after the worker's batches, a gap it fills by replay, and a restart
// of the worker, is exactly what the worker announced and still holds, and
// every hash is the sha256_cbor chain of its tokens (the peer recomputes
// each). Endpoints are ipc:// (bound, as vLLM binds them) in a temporary
// folder, so a restarted worker binds the same ones.
import { type ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { type Worker, startWorker } from '../../lib/serving';
import { blockDigests, noneHash, wireHash } from '../../lib/serving/worker/kv-events/block-hash';
import { FIXTURES, PY, pythonZmqMissing } from '../helpers';

const SCRIPT = path.join(FIXTURES, 'kv_events_peer.py');
const missing = pythonZmqMissing();
if (missing) console.warn(`KV events interop skipped: ${missing}`);

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-kv-events-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

interface Dump {
  last: number | null;
  replaying: boolean;
  hashes: string[];
  counts: Record<string, number>;
  errors: string[];
}

class PyPeer {
  readonly #p: ChildProcess;
  #out = '';
  #lines: string[] = [];

  constructor(args: string[]) {
    this.#p = spawn(PY, [SCRIPT, ...args], { stdio: ['pipe', 'pipe', 'pipe'] });
    this.#p.stdout!.on('data', (d) => {
      this.#out += d;
      const parts = this.#out.split('\n');
      this.#out = parts.pop()!;
      this.#lines.push(...parts);
    });
    this.#p.stderr!.on('data', (d) => this.#lines.push(`stderr: ${d}`));
  }

  async #line(pred: (l: string) => boolean, ms = 10_000): Promise<string> {
    const end = Date.now() + ms;
    for (;;) {
      const i = this.#lines.findIndex(pred);
      if (i >= 0) return this.#lines.splice(i, 1)[0];
      if (Date.now() > end || this.#p.exitCode !== null)
        throw new Error(`python peer: no answer (exit ${this.#p.exitCode}): ${this.#lines.join('\n')}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  }

  ready(): Promise<string> {
    return this.#line((l) => l === 'READY', 30_000);
  }

  async cmd(c: string): Promise<Record<string, unknown>> {
    this.#p.stdin!.write(`${c}\n`);
    return JSON.parse(await this.#line((l) => l.startsWith('{')));
  }

  dump(): Promise<Dump> {
    return this.cmd('DUMP') as unknown as Promise<Dump>;
  }

  /** Polls until the peer's index is `want` (and no replay runs), within a bound; returns its last dump. */
  async until(want: () => string[], ms = 20_000): Promise<Dump> {
    const end = Date.now() + ms;
    for (;;) {
      const d = await this.dump();
      if (!d.replaying && JSON.stringify(d.hashes) === JSON.stringify(want())) return d;
      if (Date.now() > end) return d;
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  stop(): void {
    this.#p.kill();
  }
}

const announced = (w: Worker) => () => w.kvEvents!.announced().map(String).sort();

async function complete(w: Worker, prompt: string): Promise<void> {
  const r = await fetch(`${w.address}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: w.modelId, prompt, max_tokens: 2 }),
  });
  expect(r.status).toBe(200);
  await r.text();
}

const SYSTEM = 'You are a careful assistant. Answer in one short sentence, and be exact about it. ';
const prompt = (i: number) => `${SYSTEM}Question ${i}: what is ${i} times ${i + 1}? Think it through.`;

describe.skipIf(missing)('KV events: a Python consumer rebuilds the worker index', () => {
  it('from the live stream, across a gap (replay) and a restart', async () => {
    const pub = `ipc://${dir}/pub`;
    const replay = `ipc://${dir}/replay`;
    const topic = 'kv@127.0.0.1:8000@nixl-node/synthetic';
    const kvEvents = (encoding: 'map' | 'array') => ({
      enable_kv_cache_events: true,
      endpoint: pub,
      replay_endpoint: replay,
      topic,
      buffer_steps: 1000,
      encoding,
    });
    // 48 blocks of 16 tokens: the prompts below (8 blocks each, 5 shared) overflow it, so blocks are evicted.
    let w = await startWorker({ blocks: 48, kvEvents: kvEvents('map') });
    const peer = new PyPeer([pub, replay, topic]);
    try {
      await peer.ready();
      const health = (await (await fetch(`${w.address}/health`)).json()) as Record<string, unknown>;
      expect(health.kv_events).toEqual({ endpoint: pub, replay_endpoint: replay, topic, block_size: 16 });

      // Live stream, evictions included.
      for (let i = 0; i < 20; i++) await complete(w, prompt(i));
      let d = await peer.until(announced(w));
      expect(d.errors).toEqual([]);
      expect(d.hashes).toEqual(announced(w)());
      expect(d.counts.removed).toBeGreaterThan(0);
      // The worker holds what its cache holds: the last prompt's blocks, hashed from its /tokenize ids.
      const tok = await fetch(`${w.address}/tokenize`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: prompt(19) }),
      });
      const { tokens, count } = (await tok.json()) as { tokens: number[]; count: number };
      expect(count).toBe(Buffer.byteLength(prompt(19)));
      const last = blockDigests(tokens, 16, noneHash()).map((h) => String(wireHash(h)));
      expect(d.hashes).toEqual(expect.arrayContaining(last));

      // A gap: the peer loses 3 batches, sees the next seq, and replays the range.
      await peer.cmd('DROP 3');
      for (let i = 20; i < 26; i++) await complete(w, prompt(i));
      d = await peer.until(announced(w));
      expect(d.errors).toEqual([]);
      expect(d.hashes).toEqual(announced(w)());
      expect(d.counts.gaps).toBeGreaterThanOrEqual(1);
      expect(d.counts.replays).toBeGreaterThanOrEqual(2);

      // A restart (positional events this time): seq from 0 again, AllBlocksCleared first, same hashes for a prompt.
      await w.close();
      w = await startWorker({ blocks: 48, kvEvents: kvEvents('array') });
      // Its AllBlocksCleared (seq 0) went out before the peer's SUB reconnected: the next batch's seq, not past
      // the last one seen, is how the peer learns of the restart, so the requests wait for the reconnection.
      const end = Date.now() + 10_000;
      while ((await peer.dump()).counts.connects < 2 && Date.now() < end) await new Promise((r) => setTimeout(r, 100));
      await new Promise((r) => setTimeout(r, 300)); // the subscription reaches the new PUB
      await complete(w, prompt(19));
      await complete(w, prompt(30));
      d = await peer.until(announced(w));
      expect(d.errors).toEqual([]);
      expect(d.hashes).toEqual(announced(w)());
      expect(d.hashes).toEqual(expect.arrayContaining(last));
      expect(d.counts.restarts + d.counts.cleared).toBeGreaterThanOrEqual(2);
    } finally {
      peer.stop();
      await w.close();
    }
  });
});
