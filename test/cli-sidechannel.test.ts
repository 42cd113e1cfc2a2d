// nixl-node sidechannel fetch|serve, as an operator runs them: serve
// synthetic metadata, fetch it back (text and --json), and fail with the
// error's code on a wrong hash, a missing rank, or nobody listening.
import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { freePort, ROOT } from './helpers';

const bin = path.join(ROOT, 'bin', 'nixl-node.js');
let server: ChildProcess | undefined;
afterEach(async () => {
  if (server && server.exitCode === null) {
    server.kill('SIGKILL');
    await once(server, 'exit');
  }
  server = undefined;
});

function cli(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [bin, ...args], { encoding: 'utf8' }, (e, stdout, stderr) =>
      resolve({ code: e ? ((e as { code?: number }).code ?? 1) : 0, stdout, stderr }),
    );
  });
}

async function serve(method: string, port: number): Promise<ChildProcess> {
  server = spawn(
    process.execPath,
    [
      bin,
      'sidechannel',
      'serve',
      `--port=${port}`,
      '--tp-size=2',
      `--method=${method}`,
      '--synthetic',
      '--hash',
      'abc123',
    ],
    {
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  let out = '';
  server.stdout!.on('data', (d) => (out += d));
  for (let i = 0; i < 100 && !out.includes('serving'); i++) await new Promise((r) => setTimeout(r, 50));
  expect(out).toContain(`127.0.0.1:${port}`);
  return server;
}

describe.each(['zmq', 'http'])('sidechannel over %s', (method) => {
  it('fetch prints what serve serves; wrong hash, missing rank: the error code and a non-zero exit', async () => {
    const port = await freePort();
    const srv = await serve(method, port);
    const text = await cli(['sidechannel', 'fetch', '--port', String(port), '--tp-rank', '1', '--method', method]);
    expect(text.code, text.stderr).toBe(0);
    expect(text.stdout).toMatch(/engine id\s+synthetic/);
    const json = await cli([
      'sidechannel',
      'fetch',
      `--port=${port}`,
      '--tp-rank=1',
      `--method=${method}`,
      '--json',
      '--expect-hash=abc123',
    ]);
    expect(json.code, json.stderr).toBe(0);
    const j = JSON.parse(json.stdout);
    expect(j).toMatchObject({
      wire: 'v0.13',
      method,
      compatibilityHash: 'abc123',
      hashVerdict: 'match',
      engineId: 'synthetic',
      numBlocks: 1024,
      blockSize: 16,
    });
    expect(j.kvCachesBaseAddr[0]).toBe(String(0x7f0000000000n + (1n << 32n)));
    expect(Buffer.from(j.agentMetadata, 'hex').toString()).toBe('synthetic agent metadata, tp rank 1');
    expect(typeof j.rttMs).toBe('number');
    const bad = await cli([
      'sidechannel',
      'fetch',
      '--port',
      String(port),
      '--method',
      method,
      '--expect-hash',
      'nope',
    ]);
    expect(bad.code).not.toBe(0);
    expect(bad.stderr).toContain('NIXL_ERR_MISMATCH');
    const missing = await cli([
      'sidechannel',
      'fetch',
      '--port',
      String(port),
      '--method',
      method,
      '--tp-rank',
      '7',
      '--timeout-ms',
      '2000',
    ]);
    expect(missing.code).not.toBe(0);
    expect(missing.stderr).toContain('NIXL_ERR_NOT_FOUND');
    srv.kill('SIGTERM');
    const [code] = await once(srv, 'exit');
    expect(code).toBe(0);
  }, 30_000);
});

it('nobody listening: a timeout with its code; bad usage: exit code 2', async () => {
  const port = await freePort();
  const none = await cli(['sidechannel', 'fetch', '--port', String(port), '--timeout-ms', '300']);
  expect(none.code).toBe(1);
  expect(none.stderr).toMatch(/NIXL_ERR_TIMEOUT/);
  for (const args of [
    ['sidechannel', 'fetch', '--port', String(port), '--wire', 'v12'],
    ['sidechannel', 'fetch'],
    ['sidechannel', 'fetch', '--port', 'x'],
    ['sidechannel', 'serve', '--port', '0', '--tp-size', '2'],
    ['sidechannel', 'serve', '--port', '0', '--synthetic'],
    ['sidechannel', 'frob'],
  ]) {
    const r = await cli(args);
    expect(r.code, args.join(' ')).toBe(2);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
  }
});
