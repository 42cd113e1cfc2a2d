// The nixl-node command (npm run demo / bench run it too): the demo, small,
// must verify every byte and free every request; bad input is one line on
// stderr and exit code 2, never a stack trace.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
// The compiled module: it finds bin/ from dist/demo/, as the installed package does.
import { exitReason, start } from '../../dist/demo/serving';
import { engines } from '../../lib';
import { ROOT } from '../helpers';

const bin = path.join(ROOT, 'bin', 'nixl-node.js');
const cli = [bin, 'demo'];

it.each([
  [['--prefill-tp', '2', '--decode-tp', '4', '--layers', '4', '--blocks', '32', '--requests', '8']],
  [
    [
      '--prefill-tp',
      '4',
      '--decode-tp',
      '2',
      '--layers',
      '2',
      '--blocks',
      '16',
      '--method',
      'http',
      '--block-kib',
      '16',
    ],
  ],
  [['--mla', '--layers', '3', '--blocks', '16', '--requests', '4']],
])(
  'demo %j',
  (args) => {
    const out = execFileSync(process.execPath, [...cli, ...args, '--engine=loopback'], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    expect(out).toMatch(/verified\s+every byte/);
    expect(out).toMatch(/prefill freed\s+(\d+)\/\1 requests after all decode reads/);
  },
  60_000,
);

it('demo --json FILE: what ran (geometry, every request) and what was measured, per round', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-demo-json-'));
  const file = path.join(dir, 'demo.json');
  const args = ['--layers', '2', '--blocks', '16', '--requests', '4', '--rounds', '2', '--engine=loopback'];
  execFileSync(process.execPath, [...cli, ...args, '--json', file], { stdio: 'ignore' });
  const r = JSON.parse(fs.readFileSync(file, 'utf8'));
  expect(r).toMatchObject({
    ok: true,
    failures: [],
    engine: 'loopback',
    method: 'zmq',
    progressThread: 'prefill',
    badRows: 0,
    released: 8,
    expired: 0,
    geometry: {
      prefillTp: 2,
      decodeTp: 4,
      layers: 2,
      regions: 4,
      blocks: 16,
      heads: 8,
      mla: false,
      blockKib: 64,
      prefillBlockBytes: 32 << 10,
      decodeBlockBytes: 16 << 10,
      requests: 4,
      blocksPerRequest: 4,
      inFlight: 4,
      rounds: 2,
    },
  });
  // Every round's requests, so that another program can pull exactly the same blocks.
  expect(r.plan).toHaveLength(2);
  for (const round of r.plan) {
    expect(round).toHaveLength(4);
    expect(round.flatMap((q: { remote: number[] }) => q.remote).sort((a: number, b: number) => a - b)).toEqual(
      Array.from({ length: 16 }, (_, i) => i),
    );
    expect(new Set(round.flatMap((q: { local: number[] }) => q.local)).size).toBe(16);
  }
  // 4 decode ranks x 2 rounds x 16 blocks x 4 regions of 16 KiB.
  expect(r.bytes).toBe(4 * 2 * 16 * 4 * (16 << 10));
  expect(r.descriptors).toBe(4 * 2 * 16 * 4);
  expect(r.handshakeMs).toHaveLength(4);
  expect(r.rounds.map((x: { round: number }) => x.round)).toEqual([0, 1]);
  for (const x of r.rounds) {
    expect(x.bytes).toBe(r.bytes / 2);
    for (const k of ['wallMs', 'gbps', 'requestMs', 'usPerDescriptor']) expect(x[k]).toBeGreaterThan(0);
  }
  expect(r.firstGbps).toBe(r.rounds[0].gbps);
  expect(r.laterGbps).toEqual({ median: r.rounds[1].gbps, min: r.rounds[1].gbps, max: r.rounds[1].gbps });
  expect(r.memcpyGbps).toBeGreaterThan(0);
  expect(r.native).toBeUndefined();
  fs.rmSync(dir, { recursive: true, force: true });
}, 60_000);

// On one host UCX copies a READ inside the progress call; the decode ranks run
// without NIXL's progress thread by default, and every mode still moves every byte.
describe.skipIf(!engines.includes('nixl'))('demo on NIXL', () => {
  it.each(['prefill', 'both', 'none'])(
    '--progress-thread %s: every byte verified, every request freed, the mode in the JSON',
    (mode) => {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-demo-pt-'));
      const file = path.join(dir, 'demo.json');
      const args = ['--layers', '2', '--blocks', '16', '--requests', '4', '--rounds', '2', '--engine=nixl'];
      const out = execFileSync(process.execPath, [...cli, ...args, '--progress-thread', mode, '--json', file], {
        encoding: 'utf8',
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      expect(out).toMatch(/verified\s+every byte/);
      const r = JSON.parse(fs.readFileSync(file, 'utf8'));
      expect(r).toMatchObject({ ok: true, engine: 'nixl', progressThread: mode, badRows: 0, released: 8 });
      expect(r.native).toBeDefined();
      fs.rmSync(dir, { recursive: true, force: true });
    },
    60_000,
  );
});

it.each(['http', 'zmq'])(
  'demo --serving over %s: proxy and workers as processes, every answer and KV byte checked, a JSON summary',
  (transport) => {
    const out = execFileSync(
      process.execPath,
      [...cli, '--serving', '--requests', '40', '--transport', transport, '--json'],
      {
        encoding: 'utf8',
        stdio: ['ignore', 'pipe', 'pipe'],
      },
    );
    const summary = JSON.parse(out.trim().split('\n').at(-1)!);
    expect(summary).toMatchObject({
      requests: 40,
      completed: 40,
      failed: 0,
      transport,
      prefillFreedByRead: 40,
      errors: [],
    });
    expect(summary.verifiedBytes).toBeGreaterThan(0);
    for (const k of ['latencyMsP50', 'latencyMsP99', 'requestsPerSecond']) expect(summary[k]).toBeGreaterThan(0);
    const text = execFileSync(process.execPath, [...cli, '--serving', '--requests', '8', '--transport', transport], {
      encoding: 'utf8',
    });
    expect(text).toMatch(/completed\s+8, every answer equal/);
  },
  60_000,
);

function fails(args: string[]): { status?: number; stderr?: string; stdout?: string } {
  try {
    execFileSync(process.execPath, [bin, ...args], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    return e as { status?: number; stderr?: string };
  }
  throw new Error(`nixl-node ${args.join(' ')} succeeded`);
}

it.each([
  [['demo', '--decode-tp', '3'], /heads must split over both TP sizes/],
  [['demo', '--blocks=abc'], /--blocks must be an integer/],
  [['demo', '--blocks', '100000000'], /more than one Buffer can/],
  [['demo', '--layers=64', '--blocks=60000', '--block-kib=64'], /more than one Buffer can|is free/],
  [['demo', '--method', 'grpc'], /--method must be one of zmq, http/],
  [['demo', '--engine', 'loopback', '--no-progress-thread'], /--no-progress-thread: only with --engine nixl/],
  [['demo', '--engine', 'loopback', '--progress-thread', 'both'], /--progress-thread both: only with --engine nixl/],
  [['demo', '--progress-thread', 'sometimes'], /--progress-thread must be one of prefill, both, none/],
  [['demo', '--no-progress-thread', '--progress-thread', 'both'], /contradicts --progress-thread both/],
  [['demo', '--bogus'], /Unknown option '--bogus'/],
  [['demo', '--json='], /--json needs a file name/],
  [['bench', '--only=nothing'], /unknown section/],
  [['frobnicate'], /unknown command 'frobnicate'/],
  [['demo', '--serving', '--transport', 'smtp'], /--transport must be one of http, zmq/],
  [['proxy', '--prefill', 'http://x'], /give prefill and decode workers/],
  [['proxy', '--pd-addrs', 'tcp://127.0.0.1:1', '--policy', 'random'], /--policy must be one of/],
  [['worker', '--transport', 'udp'], /--transport must be one of http, zmq/],
  [['worker', '--wire', 'v1'], /--wire must be one of/],
  ...(engines.includes('nixl') ? [] : [[['demo', '--engine', 'nixl'], /NIXL is not compiled in/]]),
] as Array<[string[], RegExp]>)('nixl-node %j: one line, exit code 2', (args, message) => {
  const r = fails(args);
  expect(r.status).toBe(2);
  expect(r.stderr).toMatch(message);
  expect(r.stderr!.trim().split('\n')).toHaveLength(1);
});

it('--help everywhere, and info says what loaded', () => {
  for (const args of [
    ['--help'],
    ['demo', '--help'],
    ['bench', '-h'],
    ['info', '--help'],
    ['proxy', '--help'],
    ['worker', '-h'],
    ['demo', '--serving', '--help'],
  ]) {
    expect(execFileSync(process.execPath, [bin, ...args], { encoding: 'utf8' })).toMatch(/Usage: nixl-node/);
  }
  const info = JSON.parse(execFileSync(process.execPath, [bin, 'info', '--json'], { encoding: 'utf8' }));
  expect(info.engines).toEqual(engines);
  expect(info.addon).toMatch(/\.node$/);
});

describe('demo --serving names how a process it started died', () => {
  it('a worker killed by a signal before it was ready: the signal, not "exited null"', async () => {
    const err = await start(['worker', '--blocks', '16'], (p) => p.kill('SIGKILL')).catch((e: Error) => e);
    expect(String(err)).toMatch(/nixl-node worker was killed by SIGKILL before it was ready/);
  });

  it('a worker that fails: its exit code and its last stderr lines', async () => {
    const err = await start(['worker', '--blocks', 'many']).catch((e: Error) => e);
    expect(String(err)).toMatch(/nixl-node worker exited with code 2 before it was ready: .*--blocks/);
  });

  it('exitReason says code or signal', () => {
    expect(exitReason(3, null)).toBe('exited with code 3');
    expect(exitReason(null, 'SIGSEGV')).toBe('was killed by SIGSEGV');
  });
});
