// npm run demo's CLI, small: it must verify every byte and free every request.
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { ROOT } from './helpers';

const cli = path.join(ROOT, 'dist', 'demo', 'cli.js');

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
    const out = execFileSync(process.execPath, [cli, ...args, '--engine', 'loopback'], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    expect(out).toMatch(/verified\s+every byte/);
    expect(out).toMatch(/prefill freed\s+(\d+)\/\1 requests after all decode reads/);
  },
  60_000,
);

it('demo rejects bad options with a clear message and exit code 1', () => {
  let err: { status?: number; stderr?: string } = {};
  try {
    execFileSync(process.execPath, [cli, '--decode-tp', '3'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    err = e as typeof err;
  }
  expect(err.status).toBe(1);
  expect(err.stderr).toMatch(/heads must split over both TP sizes/);
});
