// A vLLM-format push peer on NIXL's Python API (test/fixtures/vllm_nixl_push_peer.py) as a child process,
// and why it cannot run here (no addon built against NIXL, or no nixl_cu12 / msgpack / zmq for Python).
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import * as path from 'node:path';
import { engines } from '../../lib';
import { FIXTURES } from '../helpers';

const PY = '/usr/bin/python3';
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
