// A vLLM-format push peer on NIXL's Python API (test/fixtures/vllm_nixl_push_peer.py) as a child process,
// and why it cannot run here (no addon built against NIXL, or no nixl_cu12 / msgpack / zmq for Python);
// the nixl-node ranks on NIXL that the push tests pair with it, and their push roles.
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import * as path from 'node:path';
import { afterEach } from 'vitest';
import { KvPushReceiver, KvPushSender, NixlAgent, allocate, engines, servePrefill, type KvLayout } from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';
import { FIXTURES, PY } from '../helpers';
import { BLOCKS, BLOCK, PUSH_HASH, REGIONS, fill, quiet, rankLayout } from './push-helpers';

const SCRIPT = path.join(FIXTURES, 'vllm_nixl_push_peer.py');

/** Why the Python NIXL peer cannot run, or undefined. */
export function pythonNixlMissing(): string | undefined {
  if (!engines.includes('nixl')) return 'the addon was built without NIXL';
  try {
    execFileSync(PY, ['-c', 'import nixl_cu12, msgpack, zmq'], { stdio: 'pipe', timeout: 60_000 });
  } catch {
    return `${PY} cannot import nixl_cu12, msgpack and zmq (source a NIXL install's environment)`;
  }
  return undefined;
}

/** A Python peer; `line(re)` waits for a stdout line matching re, `digests()` the BLOCK lines so far. */
export function pyPeer(args: string[], env: NodeJS.ProcessEnv = {}) {
  const p: ChildProcess = spawn(PY, [SCRIPT, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  let out = '';
  let err = '';
  const exited = new Promise<number | null>((r) => p.on('exit', (c) => r(c)));
  p.stdout!.on('data', (d) => (out += d));
  p.stderr!.on('data', (d) => (err += d));
  const line = async (re: RegExp, ms = 20_000): Promise<RegExpMatchArray> => {
    const end = Date.now() + ms;
    for (;;) {
      const m = out
        .split('\n')
        .map((l) => l.match(re))
        .find(Boolean);
      if (m) return m;
      if (Date.now() > end || p.exitCode !== null)
        throw new Error(`python peer: no ${re} (exit ${p.exitCode})\n${out}\n${err.slice(-2000)}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  };
  const digests = () =>
    new Map([...out.matchAll(/^BLOCK (\d+) (\d+) ([0-9a-f]{64})$/gm)].map((m) => [`${m[1]}/${m[2]}`, m[3]]));
  return { p, line, exited, digests, output: () => `${out}\n${err.slice(-2000)}`, stderr: () => err };
}

/** What a test opened, closed in reverse order after each test (a close that throws is skipped). */
export const open: (() => unknown)[] = [];
afterEach(async () => {
  for (const f of open.splice(0).reverse())
    await Promise.resolve()
      .then(f)
      .catch(() => undefined);
});

export interface NixlRank {
  agent: NixlAgent;
  mem: Buffer;
  layout: KvLayout;
  server: HandshakeServer;
}

/**
 * A rank on NIXL serving its side channel: memory filled from `seed` (0: all zero, a clean target),
 * on UCX's ucx_error_handling_mode `mode` (unset: NIXL's default).
 */
export async function nixlRank(name: string, engineId: string, seed: number, mode?: string): Promise<NixlRank> {
  const agent = new NixlAgent(name, {
    engine: 'nixl',
    backendParams: mode ? { UCX: { ucx_error_handling_mode: mode } } : undefined,
  });
  open.push(() => agent.close());
  const mem = allocate(REGIONS * BLOCKS * BLOCK);
  if (seed) fill(mem, seed);
  else mem.fill(0);
  agent.registerMemory(mem);
  const layout = rankLayout(engineId, mem);
  const server = await servePrefill({ ranks: [{ agent, layout }], compatibilityHash: PUSH_HASH, port: 0 });
  open.push(() => server.close());
  return { agent, mem, layout, server };
}

/** The push sender of a prefill rank, its lease `leaseMs`. */
export function rankSender(p: NixlRank, leaseMs: number): KvPushSender {
  const sender = new KvPushSender({
    agent: p.agent,
    layout: p.layout,
    expectedHash: PUSH_HASH,
    leaseMs,
    logger: quiet,
  });
  open.push(() => sender.close());
  return sender;
}

/** The push receiver of a decode rank, its lease and deadline `ms`. */
export function rankReceiver(d: NixlRank, ms: number): KvPushReceiver {
  const receiver = new KvPushReceiver({
    agent: d.agent,
    layout: d.layout,
    decodeHost: '127.0.0.1',
    decodePort: d.server.basePort,
    expectedHash: PUSH_HASH,
    kvLeaseMs: ms,
    timeoutMs: ms,
  });
  open.push(() => receiver.close());
  return receiver;
}

/**
 * A Python prefill (engine id py-pre, its blocks 1, 2, 3) and a nixl-node decode rank `name` with its
 * receiver (lease and deadline `ms`), and the kv_transfer_params a proxy would give the decode.
 */
export async function pyPrefillToRank(name: string, ms: number, env: NodeJS.ProcessEnv = {}) {
  const py = pyPeer(['prefill', PUSH_HASH, 'py-pre', '1,2,3'], env);
  open.push(() => py.p.kill());
  const port = Number((await py.line(/^READY (\d+)$/))[1]);
  const d = await nixlRank(name, 'D', 0);
  const receiver = rankReceiver(d, ms);
  const params = {
    do_remote_prefill: true,
    remote_engine_id: 'py-pre',
    remote_request_id: 'router-9',
    remote_host: '127.0.0.1',
    remote_port: port,
    tp_size: 1,
    pp_size: 1,
  };
  return { py, d, receiver, params };
}
