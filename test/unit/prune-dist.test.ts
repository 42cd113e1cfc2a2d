// scripts/prune-dist.js: what tsc emitted for a source that is gone leaves
// dist/, so a moved module's old code is neither loaded nor packed.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import { createRequire } from 'node:module';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterEach, expect, it } from 'vitest';
import { prune } from '../../scripts/prune-dist.js';

let root: string | undefined;
afterEach(() => {
  if (root) fs.rmSync(root, { recursive: true, force: true });
  root = undefined;
});

function tree(files: Record<string, string>): string {
  root = fs.mkdtempSync(path.join(os.tmpdir(), 'prune-dist-'));
  for (const [f, text] of Object.entries(files)) {
    fs.mkdirSync(path.dirname(path.join(root, f)), { recursive: true });
    fs.writeFileSync(path.join(root, f), text);
  }
  return root;
}

/** What a fresh Node process loads for require(file). */
const loads = (file: string): string =>
  execFileSync(process.execPath, ['-p', `require(${JSON.stringify(file)})`], { encoding: 'utf8' }).trim();

const list = (dir: string): string[] =>
  fs.existsSync(dir) ? (fs.readdirSync(dir, { recursive: true }) as string[]).sort() : [];

it('removes the outputs of a moved source, keeps those of a present one, and what a folder import now loads', () => {
  const r = tree({
    'lib/agent/index.ts': '',
    'lib/agent/agent.ts': '',
    'lib/errors.ts': '',
    'dist/lib/agent.js': 'module.exports = "stale";',
    'dist/lib/agent.d.ts': '',
    'dist/lib/agent.js.map': '',
    'dist/lib/agent.d.ts.map': '',
    'dist/lib/agent/index.js': 'module.exports = require("./agent");',
    'dist/lib/agent/agent.js': 'module.exports = "fresh";',
    'dist/lib/errors.js': '',
    'dist/lib/errors.d.ts': '',
    'dist/lib/gone/only.js': '',
    'dist/lib/notes.txt': '',
  });
  expect(loads(path.join(r, 'dist/lib/agent'))).toBe('stale');
  expect(prune(r).sort()).toEqual(
    ['lib/agent.d.ts', 'lib/agent.d.ts.map', 'lib/agent.js', 'lib/agent.js.map', 'lib/gone/only.js'].map((f) =>
      path.normalize(f),
    ),
  );
  expect(list(path.join(r, 'dist/lib'))).toEqual(
    ['agent', 'agent/agent.js', 'agent/index.js', 'errors.d.ts', 'errors.js', 'notes.txt'].map((f) =>
      path.normalize(f),
    ),
  );
  expect(loads(path.join(r, 'dist/lib/agent'))).toBe('fresh');
  expect(prune(r)).toEqual([]);
});

it('is a no-op without dist/', () => {
  expect(prune(tree({ 'lib/x.ts': '' }))).toEqual([]);
});

it('a stale folder that another prune removes while this one walks it fails neither (two test runs at once)', () => {
  const r = tree({
    'lib/x.ts': '',
    'dist/lib/x.js': '',
    'dist/lib/gone/a.js': '',
    'dist/lib/gone/a.d.ts': '',
    'dist/lib/gone/deeper/b.js': '',
  });
  // The other prune runs right after this one lists dist/lib/gone: every
  // name this one then acts on is already gone. The script's own fs module.
  const nodeFs = createRequire(__filename)('node:fs') as typeof fs;
  const readdir = nodeFs.readdirSync;
  const gone = path.join(r, 'dist/lib/gone');
  const patched = ((dir: fs.PathLike, opts?: unknown) => {
    const listed = readdir.call(nodeFs, dir, opts as never);
    if (String(dir) === gone) nodeFs.rmSync(gone, { recursive: true, force: true });
    return listed;
  }) as typeof fs.readdirSync;
  nodeFs.readdirSync = patched;
  try {
    expect(prune(r)).toEqual([]);
  } finally {
    nodeFs.readdirSync = readdir;
  }
  expect(list(path.join(r, 'dist/lib'))).toEqual(['x.js']);
});
