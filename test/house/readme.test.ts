// Doc test: every TypeScript block of README.md and docs/*.md is a complete program that
// compiles under strict TypeScript (nodenext) against the package by name,
// and runs, printing what its comments say (`// <printed>` after a
// console.log). Blocks that only export functions (the NIXL/VRAM one) run
// as modules that define them.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { ROOT, strictTsApp } from '../helpers';

const DOCS = [
  'README.md',
  ...fs
    .readdirSync(path.join(ROOT, 'docs'))
    .filter((f) => f.endsWith('.md'))
    .map((f) => `docs/${f}`),
];
const blocks = DOCS.flatMap((f) =>
  [...fs.readFileSync(path.join(ROOT, f), 'utf8').matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]),
);
const readmeBlocks = [...fs.readFileSync(path.join(ROOT, 'README.md'), 'utf8').matchAll(/```ts\n/g)].length;
const app = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-readme-'));
afterAll(() => fs.rmSync(app, { recursive: true, force: true }));

// The package by name, as a user's app sees it (this checkout, built).
strictTsApp(app, { include: ['*.mts'] });
fs.symlinkSync(ROOT, path.join(app, 'node_modules', 'nixl-node'));
fs.symlinkSync(path.join(ROOT, 'node_modules', 'prom-client'), path.join(app, 'node_modules', 'prom-client'));
fs.writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'readme-app', private: true }));
for (const [i, b] of blocks.entries()) fs.writeFileSync(path.join(app, `block${i}.mts`), b);

it('README.md has its three examples, docs/ more', () => {
  expect(readmeBlocks).toBe(3);
  expect(blocks.length).toBeGreaterThanOrEqual(6);
});

it('every block compiles under strict TypeScript, importing nixl-node by name', () => {
  execFileSync(process.execPath, [path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', '.'], {
    cwd: app,
    encoding: 'utf8',
  });
}, 60_000);

it.each(blocks.map((b, i) => [i, b] as const))(
  'block %i runs and prints what its comments say',
  (i, b) => {
    const out = execFileSync(process.execPath, [`out/block${i}.mjs`], {
      cwd: app,
      encoding: 'utf8',
      env: { ...process.env, NIXL_NODE_ENGINE: 'loopback' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    // `console.log(...);   // expected output` lines, in order.
    const expected = [...b.matchAll(/console\.log\(.*\);\s*\/\/ (.*)$/gm)].map((m) => m[1].split(':')[0].trim());
    const lines = out.trim().split('\n');
    for (const [k, want] of expected.entries()) {
      expect(lines[k], `line ${k} of block ${i}`).toContain(want.replace(/\.\.\./g, '').trim());
    }
  },
  60_000,
);
