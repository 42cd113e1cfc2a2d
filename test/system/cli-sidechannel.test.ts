// nixl-node sidechannel fetch|serve, as an operator runs them: serve
// synthetic metadata, fetch it back (text and --json), and fail with the
// error's code on a wrong hash, a missing rank, or nobody listening.
import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { freePort, onFreePort, ROOT } from '../helpers';

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

/** `sidechannel serve` on a free port (another one if it was taken meanwhile). */
async function serveFree(method: string, wire: string, extra: string[] = []): Promise<number> {
  return onFreePort(async (port) => {
    await serve(method, port, wire, extra);
    return port;
  });
}

async function serve(method: string, port: number, wire: string, extra: string[] = []): Promise<ChildProcess> {
  server = spawn(
    process.execPath,
    [
      bin,
      'sidechannel',
      'serve',
      `--port=${port}`,
      '--tp-size=2',
      `--method=${method}`,
      `--wire=${wire}`,
      '--synthetic',
      '--hash',
      'abc123',
      ...extra,
    ],
    {
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  let out = '';
  server.stdout!.on('data', (d) => (out += d));
  server.stderr!.on('data', (d) => (out += d));
  for (let i = 0; i < 100 && !out.includes('serving') && server.exitCode === null; i++)
    await new Promise((r) => setTimeout(r, 50));
  if (server.exitCode !== null) throw new Error(`sidechannel serve exited: ${out}`);
  expect(out).toContain(`127.0.0.1:${port}`);
  return server;
}

describe.each([
  ['zmq', 'v12'],
  ['http', 'v12'],
  ['zmq', 'v0.13'],
  ['http', 'v0.13'],
])('sidechannel over %s, wire %s', (method, wire) => {
  it('fetch prints what serve serves; wrong hash, missing rank: the error code and a non-zero exit', async () => {
    const port = await serveFree(method, wire);
    const srv = server!;
    const text = await cli([
      'sidechannel',
      'fetch',
      '--port',
      String(port),
      '--tp-rank',
      '1',
      '--method',
      method,
      '--wire',
      wire,
    ]);
    expect(text.code, text.stderr).toBe(0);
    expect(text.stdout).toMatch(/engine id\s+synthetic/);
    expect(text.stdout).toMatch(wire === 'v12' ? /clock offset\s+-?\d+\.\d+ ms/ : /wire v0.13/);
    const json = await cli([
      'sidechannel',
      'fetch',
      `--port=${port}`,
      '--tp-rank=1',
      `--method=${method}`,
      `--wire=${wire}`,
      '--json',
      '--expect-hash=abc123',
    ]);
    expect(json.code, json.stderr).toBe(0);
    const j = JSON.parse(json.stdout);
    expect(j).toMatchObject({
      wire,
      nixlConnectorVersion: wire === 'v12' ? 12 : 2,
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
    // Both ends are processes of this machine: the offset between their monotonic clocks is finite, not bounded.
    expect(j.clockOffsetS === null).toBe(wire === 'v0.13');
    expect(Object.keys(j)).toEqual(
      expect.arrayContaining(['blockStrides', 'ssmSizes', 'regionMembers', 'physicalBlocksPerLogical']),
    );
    // The other profile gets an error that names the mismatch.
    const other = await cli([
      'sidechannel',
      'fetch',
      '--port',
      String(port),
      '--method',
      method,
      '--wire',
      wire === 'v12' ? 'v0.13' : 'v12',
    ]);
    expect(other.code).not.toBe(0);
    expect(other.stderr).toMatch(/NIXL_ERR_MISMATCH/);
    expect(other.stderr).toMatch(new RegExp(`speaks ${wire.replace('.', '\\.')}`));
    const bad = await cli([
      'sidechannel',
      'fetch',
      '--port',
      String(port),
      '--method',
      method,
      '--wire',
      wire,
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
      '--wire',
      wire,
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

it('serve --pp-size: fetch --pp-rank reads each pipeline rank (v12, the default)', async () => {
  const port = await serveFree('zmq', 'v12', ['--pp-size', '2']);
  const r = await cli(['sidechannel', 'fetch', '--port', String(port), '--pp-rank', '1', '--tp-rank', '1', '--json']);
  expect(r.code, r.stderr).toBe(0);
  const j = JSON.parse(r.stdout);
  expect(j).toMatchObject({ wire: 'v12', ppRank: 1, tpRank: 1 });
  expect(j.kvCachesBaseAddr[0]).toBe(String(0x7f0000000000n + (1n << 40n) + (1n << 32n)));
  const none = await cli(['sidechannel', 'fetch', '--port', String(port), '--pp-rank', '2', '--timeout-ms', '2000']);
  expect(none.code).not.toBe(0);
  expect(none.stderr).toMatch(/NIXL_ERR_NOT_FOUND.*pp_rank 2/);
}, 30_000);

it('nobody listening: a timeout with its code; bad usage: exit code 2', async () => {
  const port = await freePort();
  const none = await cli(['sidechannel', 'fetch', '--port', String(port), '--timeout-ms', '300']);
  expect(none.code).toBe(1);
  expect(none.stderr).toMatch(/NIXL_ERR_TIMEOUT/);
  for (const args of [
    ['sidechannel', 'fetch', '--port', String(port), '--wire', 'v11'],
    ['sidechannel', 'fetch', '--port', String(port), '--wire', 'v0.13', '--pp-rank', '1'],
    ['sidechannel', 'serve', '--port', '0', '--tp-size', '2', '--synthetic', '--wire', 'v0.13', '--pp-size', '2'],
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
