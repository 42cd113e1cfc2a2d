// Push mode in the serving stack (docs/kv-push.md): workers with kvMode
// 'push' and `proxy --kv-mode push` dispatching both legs at once, over HTTP
// and ZeroMQ. Answers equal pull answers and one process's; a decode whose
// prefill never writes fails typed by its deadline; a dead leg aborts the other.
import { spawn, spawnSync } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterEach, describe, expect, it } from 'vitest';
import { NixlAgent } from '../../lib';
import { createHandshake } from '../../lib/handshake';
import { type PushRegistration, encodePushReg } from '../../lib/kv/push/reg';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';
import { ROOT, serveTrio } from '../helpers';

const BIN = path.join(ROOT, 'bin', 'nixl-node.js');

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

type Mode = 'pull' | 'push';
// biome-ignore lint/suspicious/noExplicitAny: answers read as JSON
type Json = Record<string, any>;

async function cluster(
  transport: 'http' | 'zmq',
  kvMode: Mode,
  o: { leaseMs?: number; pushTimeoutMs?: number; stallPrefillMs?: number } = {},
) {
  const { stallPrefillMs, ...rest } = o;
  const testHooks = { stallPrefillMs };
  const w = (name: string) => ({ name: `${name}-${kvMode}-${transport}`, blocks: 256, kvMode, ...rest, testHooks });
  return serveTrio(cleanup, {
    transport,
    prefill: w('P'),
    decode: w('D'),
    proxy: { kvMode, timeoutMs: { prefill: 10_000, decode: 10_000 } },
  });
}

const PROMPTS = ['the quick brown fox', 'push or pull, the same answer '.repeat(5), 'x'];

async function ask(url: string, prompt: string, stream = false) {
  const r = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    body: JSON.stringify({ model: MODEL_NAME, prompt, max_tokens: 7, temperature: 0, stream }),
  });
  if (!stream) return { status: r.status, json: (await r.json()) as Json };
  let text = '';
  let info: Record<string, unknown> | undefined;
  for (const line of (await r.text()).split('\n').filter((l) => l.startsWith('data: {'))) {
    const c = JSON.parse(line.slice(6));
    text += c.choices[0]?.text ?? '';
    info = c.nixl_node ?? info;
  }
  return { status: r.status, json: { choices: [{ text }], nixl_node: info } as Json };
}

async function freeAgain(w: Worker, n: number, ms: number) {
  const end = performance.now() + ms;
  while (w.freeBlocks !== n && performance.now() < end) await new Promise((r) => setTimeout(r, 20));
  return w.freeBlocks;
}

describe.each(['http', 'zmq'] as const)('push serving over %s', (transport) => {
  it('push answers equal pull answers and one process, with kv_mode in nixl_node', async () => {
    const one = await startWorker({ name: `agg-${transport}`, transport: 'http', blocks: 256 });
    cleanup.push(() => one.close());
    const got: Record<string, string[]> = { one: [], pull: [], push: [] };
    for (const p of PROMPTS) got.one.push((await ask(one.address, p)).json.choices[0].text);
    for (const mode of ['pull', 'push'] as const) {
      const c = await cluster(transport, mode);
      for (const [i, p] of PROMPTS.entries()) {
        const { status, json } = await ask(c.proxy.url, p, i === 1);
        expect(status, JSON.stringify(json)).toBe(200);
        expect(json.nixl_node).toMatchObject({ kv_moved: true, kv_mode: mode });
        expect(json.nixl_node.verified_bytes).toBeGreaterThan(0);
        got[mode].push(json.choices[0].text);
      }
      // Every hold went back: the push prefill's blocks once written, the decode's once decoded.
      expect(await freeAgain(c.prefill, 256, 5000)).toBe(256);
      expect(await freeAgain(c.decode, 256, 5000)).toBe(256);
      if (mode === 'push') expect(c.prefill.stats.freedByRead).toBe(PROMPTS.length);
    }
    expect(got.one.every((t) => t.length > 0)).toBe(true);
    expect(got.pull).toEqual(got.one);
    expect(got.push).toEqual(got.one);
  });

  it('a pull proxy in front of push workers, and the reverse, answers a typed error', async () => {
    const c = await cluster(transport, 'push');
    const pull = await startProxy({
      transport,
      prefill: [c.prefill.address],
      decode: [c.decode.address],
      healthIntervalMs: 0,
      timeoutMs: { prefill: 5000, decode: 5000 },
    });
    cleanup.push(() => pull.close());
    const a = await ask(pull.url, 'mismatch');
    expect(a.status).toBeGreaterThanOrEqual(400);
    expect(JSON.stringify(a.json)).toMatch(/push|pull|mismatch|hash/i);
    const p = await cluster(transport, 'pull');
    const push = await startProxy({
      transport,
      prefill: [p.prefill.address],
      decode: [p.decode.address],
      healthIntervalMs: 0,
      kvMode: 'push',
    });
    cleanup.push(() => push.close());
    const b = await ask(push.url, 'mismatch');
    expect(b.status).toBe(503);
    expect(b.json.error.code).toBe('kv_mode_mismatch');
  });
});

describe('push serving faults', () => {
  it('a PUSH_REG flood on the prefill (4,100 for requests that never come) does not lock real requests out', async () => {
    // A prefill slower than its decode: every registration reaches it before its offer and must wait there.
    const c = await cluster('http', 'push', { stallPrefillMs: 300, pushTimeoutMs: 5000 });
    const h = c.prefill.healthInfo() as Json;
    const fetched = await createHandshake().fetch({ host: '127.0.0.1', port: h.kv_port, tpRank: 0 });
    const flooder = new NixlAgent('push-flooder');
    cleanup.push(() => flooder.close());
    const prefillAgent = flooder.addRemoteAgent(fetched.metadata.agentMetadata);
    for (let i = 0; i < 4100; i++) {
      const reg: PushRegistration = {
        requestId: `flood-${i}`,
        decodeEngineId: 'flooder',
        decodeHost: '127.0.0.1',
        decodePort: 9,
        decodeTpSize: 1,
        localBlockIds: [[i % 256]],
        remoteEngineId: h.kv_engine_id,
        remoteHost: '127.0.0.1',
        remotePort: h.kv_port,
        remoteTpSize: 1,
        remotePpSize: 1,
      };
      flooder.sendNotif(prefillAgent, encodePushReg(reg));
      if (i % 200 === 199) await new Promise((r) => setTimeout(r, 1));
    }
    // Each registration waits for its offer (300 ms) and is paired: before, each waited out the decode's 5 s
    // deadline (502, decode 504 kv_push_timeout).
    for (const [i, p] of PROMPTS.entries()) {
      const { status, json } = await ask(c.proxy.url, `${p} after the flood ${i}`);
      expect(status, JSON.stringify(json)).toBe(200);
      expect(json.nixl_node).toMatchObject({ kv_moved: true, kv_mode: 'push' });
    }
    expect(await freeAgain(c.decode, 256, 5000)).toBe(256);
  }, 60_000);

  it('a decode whose prefill never writes fails typed by its deadline; its blocks wait out the quarantine', async () => {
    const c = await cluster('http', 'push', { pushTimeoutMs: 400, leaseMs: 300 });
    const t0 = performance.now();
    // The decode leg alone, naming the prefill: the prefill never gets the request.
    const kv = {
      do_remote_prefill: true,
      do_remote_decode: false,
      remote_engine_id: c.prefill.name,
      remote_host: '127.0.0.1',
      remote_port: (c.prefill.healthInfo() as Json).kv_port,
      tp_size: 1,
      pp_size: 1,
      remote_request_id: 'xfer-never',
      transfer_id: 'xfer-never',
      transfer_mode: 'push',
    };
    const r = await fetch(`${c.decode.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: MODEL_NAME, prompt: 'never written', max_tokens: 3, kv_transfer_params: kv }),
    });
    const ms = performance.now() - t0;
    const j = (await r.json()) as Json;
    expect(r.status, JSON.stringify(j)).toBe(504);
    expect(j.error.type).toBe('kv_push_timeout');
    expect(ms).toBeLessThan(5000);
    // Registered, so a WRITE could still land: out of use until the quarantine ends, then back.
    expect(c.decode.freeBlocks).toBeLessThan(256);
    expect(await freeAgain(c.decode, 256, 10_000)).toBe(256);
  });

  it('a prefill offered to a decode that died after registering frees its blocks at the lease, no retry', async () => {
    const c = await cluster('http', 'push', { leaseMs: 500 });
    // The prefill leg alone: no decode ever registers (it died), so only the lease frees the blocks.
    const r = await fetch(`${c.prefill.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        model: MODEL_NAME,
        prompt: 'orphaned prefill',
        max_tokens: 1,
        kv_transfer_params: { do_remote_decode: true, transfer_mode: 'push', transfer_id: 'xfer-orphan' },
      }),
    });
    const j = (await r.json()) as Json;
    expect(r.status, JSON.stringify(j)).toBe(200);
    expect(j.kv_transfer_params).toMatchObject({ transfer_mode: 'push', remote_engine_id: c.prefill.name });
    expect(c.prefill.freeBlocks).toBeLessThan(256);
    const t0 = performance.now();
    expect(await freeAgain(c.prefill, 256, 5000)).toBe(256);
    expect(performance.now() - t0).toBeGreaterThan(200);
    expect(c.prefill.stats.freedByLease).toBe(1);
    expect(c.prefill.stats.freedByRead).toBe(0);
  });

  it('decode killed after registering, through the proxy: a typed error, the prefill frees its blocks before its lease, no retry', async () => {
    const c = await cluster('http', 'push', { stallPrefillMs: 1500, leaseMs: 8000 });
    const q = ask(c.proxy.url, 'decode dies');
    // The decode has registered its blocks with the prefill, which is still computing.
    await new Promise((r) => setTimeout(r, 400));
    expect(c.decode.freeBlocks).toBeLessThan(256);
    await c.decode.close();
    const { status, json } = await q;
    expect(status, JSON.stringify(json)).toBeGreaterThanOrEqual(500);
    expect(json.error.stage).toBe('decode');
    const t0 = performance.now();
    expect(await freeAgain(c.prefill, 256, 6000)).toBe(256);
    expect(performance.now() - t0).toBeLessThan(4000);
    expect(c.prefill.stats.freedByLease).toBe(0);
    expect(c.prefill.stats.freedByRead).toBe(0);
    expect(c.proxy.stats.decodeRetries + c.proxy.stats.expiredRetries + c.proxy.stats.retries).toBe(0);
  });

  it.each(['http', 'zmq'] as const)(
    'prefill killed mid-request over %s: the proxy answers a typed error, no hang',
    async (transport) => {
      const c = await cluster(transport, 'push', { pushTimeoutMs: 3000, stallPrefillMs: 2000, leaseMs: 500 });
      // The prefill is held before it offers its blocks, and killed while both legs are in flight.
      const q = ask(c.proxy.url, 'prefill dies');
      await new Promise((r) => setTimeout(r, 300));
      await c.prefill.close();
      const t0 = performance.now();
      const { status, json } = await q;
      const ms = performance.now() - t0;
      expect(status, JSON.stringify(json)).toBeGreaterThanOrEqual(500);
      // HTTP: the prefill leg fails (connection cut); ZeroMQ says nothing, so the decode's heartbeat to the
      // prefill it registered with does: the loopback engine knows the prefill's agent is gone (peer-gone,
      // before the 3 s deadline). UCX over shared memory may not tell a closed peer: then the deadline does.
      const gone = [
        'NIXL_ERR_REMOTE_DISCONNECT',
        ...(process.env.NIXL_NODE_ENGINE === 'nixl' ? ['kv_push_timeout'] : []),
      ];
      if (transport === 'http') expect(json.error.stage).toBe('prefill');
      else {
        expect(json.error.stage).toBe('decode');
        expect(gone).toContain(json.error.code);
      }
      // HTTP: the prefill's cut connection aborts the decode leg at once; ZeroMQ: the failed heartbeat does.
      expect(ms).toBeLessThan(transport === 'http' ? 2000 : 6000);
      // The decode's blocks: back at once (aborted before any WRITE could come) or after their quarantine.
      expect(await freeAgain(c.decode, 256, 10_000)).toBe(256);
      console.log(`push prefill killed (${transport}): answered ${status} ${json.error.code} in ${ms.toFixed(0)} ms`);
    },
  );
});

describe('nixl-node proxy --kv-mode', () => {
  it('push: both legs through the command, kv_mode push in the answer', async () => {
    const pre = await startWorker({ name: 'cli-P', kvMode: 'push' });
    const dec = await startWorker({ name: 'cli-D', kvMode: 'push' });
    cleanup.push(
      () => pre.close(),
      () => dec.close(),
    );
    const p = spawn(
      process.execPath,
      [BIN, 'proxy', '--port', '0', '--kv-mode', 'push', '--prefill', pre.address, '--decode', dec.address],
      { stdio: ['ignore', 'pipe', 'ignore'] },
    );
    cleanup.push(() => p.kill('SIGKILL'));
    const url = await new Promise<string>((resolve) =>
      readline.createInterface({ input: p.stdout! }).on('line', (l) => {
        if (l.includes('"ready"')) resolve(JSON.parse(l).url);
      }),
    );
    const { status, json } = await ask(url, 'through the command');
    expect(status, JSON.stringify(json)).toBe(200);
    expect(json.nixl_node).toMatchObject({ kv_moved: true, kv_mode: 'push', worker: 'cli-D' });
  });

  it.each(['proxy', 'worker'])('%s --kv-mode sideways: a usage error', (cmd) => {
    const r = spawnSync(
      process.execPath,
      [BIN, cmd, '--kv-mode', 'sideways', ...(cmd === 'proxy' ? ['--pd-addrs', 'http://127.0.0.1:1'] : [])],
      {
        encoding: 'utf8',
        timeout: 20_000,
      },
    );
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/kv-mode/);
  });
});
