// `npm run bench` as a user runs it: every section, under both wire profiles.
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';
import { ROOT } from '../helpers';

const run = promisify(execFile);

// Under v0.13, the sections that exchange agent metadata (the rest never reads the wire profile).
const WIRE_SECTIONS = ['handshake', 'tracing', 'serving', 'multiturn', 'push', 'fleet'];

for (const wire of ['v12', 'v0.13'] as const) {
  const every = wire === 'v12';
  it(`nixl-node bench --quick runs ${every ? 'every section' : 'the wire sections'} under NIXL_WIRE=${wire}`, async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-bench-'));
    const json = path.join(dir, 'out.json');
    const { stdout } = await run(
      process.execPath,
      [
        path.join(ROOT, 'dist/cli/nixl-node.js'),
        'bench',
        '--quick',
        '--json',
        json,
        '--svg',
        path.join(dir, 'out.svg'),
        ...(every ? [] : ['--only', WIRE_SECTIONS.join(',')]),
      ],
      // Minutes on a loaded 2-core machine: a bound against a hang, not a speed check.
      { env: { ...process.env, NIXL_WIRE: wire }, timeout: 270_000 },
    );
    const r = JSON.parse(fs.readFileSync(json, 'utf8'));
    if (every) {
      expect(r.bandwidth.length).toBeGreaterThan(0);
      expect(r.coalesce.length).toBeGreaterThan(0);
      // Layer-wise KV pull against one request, per engine of the run and block size.
      for (const engine of r.engine.split(' + '))
        expect(r.layerwise.filter((x: { engine: string }) => x.engine === engine).length).toBeGreaterThan(1);
      for (const x of r.layerwise) expect(x.ratio).toBeGreaterThan(0);
      // The proxy alone over HTTP and ZeroMQ against the client calling both workers, every answer checked.
      expect(r.proxy.rows.length).toBe(3);
      for (const x of r.proxy.rows) expect([x.wrong, x.checked > 0]).toEqual([0, true]);
    }
    // vLLM's serving-benchmark figures beside ours.
    for (const x of r.serving.rows) expect(x.p99_ttft_ms).toBeGreaterThan(0);
    // zmq, http and https, each with its raw-transport baseline of the same run.
    expect(r.handshake.map((h: { method: string }) => h.method)).toEqual(
      expect.arrayContaining([
        expect.stringMatching(/^zmq/),
        expect.stringMatching(/^http /),
        expect.stringMatching(/^https/),
      ]),
    );
    for (const h of r.handshake) expect(h.ratio).toBeGreaterThan(0);
    // The proxy with tracing off, on with the no-op tracer, and exporting (the SDK is a dev dependency).
    expect(r.tracing.map((t: { mode: string }) => t.mode)).toEqual(['off', 'no-op tracer', 'exporting']);
    for (const t of r.tracing) expect(t.requestsPerSecond).toBeGreaterThan(0);
    // A real model both ways: the same answers, the KV's share of time to first token, its size per token.
    expect(r.serving.rows.map((x: { config: string }) => x.config)).toEqual(['co-located', 'disaggregated']);
    expect(r.serving.identical).toBe(r.serving.requests);
    expect(r.serving.kvBytesPerToken).toBeGreaterThan(0);
    // Multi-turn: turn 2 read turn 1's KV (the same answer both ways, or the section throws).
    for (const m of r.multiturn) expect(m.reusedTokens).toBeGreaterThan(m.historyTokens - 16);
    // Push beside pull on every engine of the run, both transports, the same answers: the synthetic model and a GGUF.
    for (const engine of r.engine.split(' + '))
      for (const model of ['synthetic', 'nixl-node-tiny']) {
        const rows = r.push.filter((x: { engine: string; model: string }) => x.engine === engine && x.model === model);
        expect(rows.map((x: { transport: string; mode: string }) => `${x.transport} ${x.mode}`).sort()).toEqual([
          'http pull',
          'http push',
          'zmq pull',
          'zmq push',
        ]);
        for (const x of rows) expect(x.identical).toBe(x.requests);
      }
    // Fleet routing: 'load' against round-robin on the same workers.
    expect(r.fleet.rows.map((x: { policy: string }) => x.policy)).toEqual(['round-robin', 'load']);
    for (const f of r.fleet.rows) expect(f.roundMs).toBeGreaterThan(0);
    expect(stdout).toMatch(/# Handshake latency/);
    expect(fs.statSync(path.join(dir, 'out.svg')).size).toBeGreaterThan(0);
    fs.rmSync(dir, { recursive: true, force: true });
  }, 300_000);
}

it('nixl-node bench --only grid: nixlbench-shaped rows per engine, op, block and batch, and the cold first transfer apart', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-grid-'));
  const json = path.join(dir, 'grid.json');
  // A small grid: 4 and 16 KiB blocks x batches 1 and 4 (--quick steps by 4).
  const { stdout } = await run(
    process.execPath,
    [
      path.join(ROOT, 'dist/cli/nixl-node.js'),
      'bench',
      '--only',
      'grid',
      '--quick',
      '--max-block-size',
      String(16 << 10),
      '--max-batch-size',
      '4',
      '--num-iter',
      '20',
      '--warmup-iter',
      '2',
      '--json',
      json,
    ],
    { timeout: 60_000 },
  );
  const r = JSON.parse(fs.readFileSync(json, 'utf8'));
  const engines = r.engine.split(' + ');
  const dist = { avg: expect.any(Number), p99: expect.any(Number) };
  expect(r.grid).toHaveLength(engines.length * 2 * 4);
  for (const row of r.grid) {
    expect(row).toMatchObject({ gbps: expect.any(Number), prepUs: dist, postUs: dist, xferUs: dist, iterations: 20 });
    expect(row.gbps).toBeGreaterThan(0);
    for (const k of ['prepUs', 'postUs', 'xferUs']) expect(row[k].p99).toBeGreaterThanOrEqual(0);
    // The median iteration lies within what the iterations took: at most avg post + avg transfer times their count.
    expect(row.medianUs).toBeGreaterThan(0);
    expect(row.medianUs).toBeLessThanOrEqual((row.postUs.avg + row.xferUs.avg) * row.iterations);
    if (row.engine === 'nixl' && row.native) {
      expect(row.ratio).toBeGreaterThan(0);
      expect(row.ratioMedian).toBeCloseTo(row.native.medianUs / row.medianUs, 6);
    }
  }
  const cells = (e: string, op: string) =>
    r.grid
      .filter((x: { engine: string; op: string }) => x.engine === e && x.op === op)
      .map((x: { blockBytes: number; batch: number }) => [x.blockBytes, x.batch]);
  for (const e of engines)
    for (const op of ['READ', 'WRITE'])
      expect(cells(e, op)).toEqual([
        [4096, 1],
        [4096, 4],
        [16384, 1],
        [16384, 4],
      ]);
  // One first transfer per engine and op, apart from the rows, beside the warm figure of its cell.
  expect(r.gridCold).toHaveLength(engines.length * 2);
  for (const c of r.gridCold)
    expect(c).toMatchObject({
      blockBytes: 4096,
      batch: 1,
      connectUs: expect.any(Number),
      prepUs: expect.any(Number),
      postUs: expect.any(Number),
      xferUs: expect.any(Number),
      warmXferUs: expect.any(Number),
    });
  expect(stdout).toMatch(/# Grid \(nixlbench's shape\)/);
  expect(stdout).toMatch(/first transfer of a fresh agent pair/);
  fs.rmSync(dir, { recursive: true, force: true });
}, 90_000);

it('nixl-node bench --only demo: the demo (a child process, --json) against the same pulls through KvPuller in this process', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-demo-row-'));
  const json = path.join(dir, 'demo.json');
  const { stdout } = await run(
    process.execPath,
    [path.join(ROOT, 'dist/cli/nixl-node.js'), 'bench', '--only', 'demo', '--quick', '--json', json],
    { timeout: 120_000 },
  );
  const r = JSON.parse(fs.readFileSync(json, 'utf8'));
  const engines: string[] = r.engine.split(' + ');
  const pair = [expect.any(Number), expect.any(Number)];
  // The demo's default job, named in the row: TP 2 -> 4, 32 layers, 64 KiB per block of all heads.
  const geometry = { prefillTp: 2, decodeTp: 4, layers: 32, blocks: 256, blockKib: 64, requests: 16, inFlight: 4 };
  expect(r.demo.rows.map((x: { engine: string }) => x.engine)).toEqual(engines);
  for (const row of r.demo.rows) {
    expect(row).toMatchObject({
      runs: 1,
      geometry,
      demoRange: pair,
      baselineRange: pair,
      ratioRange: pair,
      demoFirstGbps: expect.any(Number),
      baselineFirstGbps: expect.any(Number),
      memcpyGbps: expect.any(Number),
    });
    expect(row.cpuRatioRange).toEqual(pair);
    for (const k of ['demoGbps', 'baselineGbps', 'ratio', 'demoGbPerCpuS', 'baselineGbPerCpuS', 'cpuRatio'])
      expect(row[k]).toBeGreaterThan(0);
    expect(row.ratio).toBeCloseTo(row.demoGbps / row.baselineGbps, 5); // one run: the ratio of its medians
  }
  // One run per engine, each side with round 1 apart and the later rounds.
  expect(r.demo.runs).toHaveLength(engines.length);
  for (const x of r.demo.runs) {
    expect(x.first).toBe('demo');
    for (const s of [x.demo, x.baseline]) {
      expect(s.firstGbps).toBeGreaterThan(0);
      expect(s.laterGbps).toHaveLength(2);
    }
  }
  expect(stdout).toMatch(/# The demo against the bench for the same blocks/);
  fs.rmSync(dir, { recursive: true, force: true });
}, 150_000);
