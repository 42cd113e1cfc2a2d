// `npm run bench` as a user runs it: every section, under both wire profiles
// (the handshake section once failed under v12, the default, because its
// payload lacked a field only v12 requires).
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';
import { ROOT } from './helpers';

const run = promisify(execFile);

for (const wire of ['v12', 'v0.13'] as const) {
  it(`nixl-node bench --quick runs every section under NIXL_WIRE=${wire}`, async () => {
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
      ],
      { env: { ...process.env, NIXL_WIRE: wire }, timeout: 120_000 },
    );
    const r = JSON.parse(fs.readFileSync(json, 'utf8'));
    expect(r.bandwidth.length).toBeGreaterThan(0);
    expect(r.coalesce.length).toBeGreaterThan(0);
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
    // Fleet routing: 'load' against round-robin on the same workers.
    expect(r.fleet.rows.map((x: { policy: string }) => x.policy)).toEqual(['round-robin', 'load']);
    for (const f of r.fleet.rows) expect(f.roundMs).toBeGreaterThan(0);
    expect(stdout).toMatch(/# Handshake latency/);
    expect(fs.statSync(path.join(dir, 'out.svg')).size).toBeGreaterThan(0);
    fs.rmSync(dir, { recursive: true, force: true });
  }, 150_000);
}
