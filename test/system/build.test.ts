// Both builds must keep working: node-gyp is the primary one (npm install, npm
// test), this proves cmake-js and prebuildify (+ PREBUILDS_ONLY loading) too.
// Each runs in its own copy of the tree, since both write build/.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { ROOT } from '../helpers';

const tmp: string[] = [];
afterAll(() => {
  for (const d of tmp) fs.rmSync(d, { recursive: true, force: true });
});

function copyTree(): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-build-'));
  tmp.push(dir);
  for (const f of ['native', 'scripts', 'binding.gyp', 'CMakeLists.txt', 'package.json', '.npmrc']) {
    fs.cpSync(path.join(ROOT, f), path.join(dir, f), { recursive: true });
  }
  fs.symlinkSync(path.join(ROOT, 'node_modules'), path.join(dir, 'node_modules'));
  return dir;
}

function loadEngines(dir: string, env: NodeJS.ProcessEnv = {}): string {
  return execFileSync(
    process.execPath,
    ['-e', "const b=require('node-gyp-build');console.log(b.path('.'));console.log(b('.').engines.join(','))"],
    { cwd: dir, env: { ...process.env, ...env }, encoding: 'utf8' },
  );
}

it('cmake-js builds the same addon', () => {
  const dir = copyTree();
  execFileSync(path.join(ROOT, 'node_modules', '.bin', 'cmake-js'), ['rebuild', '--log-level', 'error'], {
    cwd: dir,
    stdio: 'pipe',
  });
  const out = loadEngines(dir);
  expect(out).toContain(path.join('build', 'Release', 'nixl_node.node'));
  expect(out).toContain('loopback');
}, 300_000);

it('prebuildify makes a prebuild that loads with PREBUILDS_ONLY=1', () => {
  const dir = copyTree();
  execFileSync(path.join(ROOT, 'node_modules', '.bin', 'prebuildify'), ['-t', '20.20.2', '--napi', '--strip'], {
    cwd: dir,
    stdio: 'pipe',
  });
  fs.rmSync(path.join(dir, 'build'), { recursive: true, force: true });
  const out = loadEngines(dir, { PREBUILDS_ONLY: '1' });
  expect(out).toContain(path.join('prebuilds', `${process.platform}-${process.arch}`));
  expect(out).toContain('loopback');
}, 300_000);

it('prebuilds never link an installed NIXL: NIXL_NODE_NO_NIXL=1 hides it from the build', () => {
  // A fake install that find-nixl.js would take.
  const prefix = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-fake-nixl-'));
  tmp.push(prefix);
  fs.mkdirSync(path.join(prefix, 'include'));
  fs.writeFileSync(path.join(prefix, 'include', 'nixl.h'), '');
  fs.mkdirSync(path.join(prefix, 'lib'));
  fs.writeFileSync(path.join(prefix, 'lib', 'libnixl.so'), '');
  const find = (env: NodeJS.ProcessEnv) =>
    execFileSync(process.execPath, [path.join(ROOT, 'scripts', 'find-nixl.js'), 'found'], {
      env: { ...process.env, ...env },
      encoding: 'utf8',
    });
  expect(find({ NIXL_PREFIX: prefix })).toBe('1');
  expect(find({ NIXL_PREFIX: prefix, NIXL_NODE_NO_NIXL: '1' })).toBe('0');
  const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'));
  expect(pkg.scripts.prebuildify).toMatch(/^NIXL_NODE_NO_NIXL=1 prebuildify /);
  expect(fs.readFileSync(path.join(ROOT, 'scripts', 'prebuild-arm64.sh'), 'utf8')).toMatch(/NIXL_NODE_NO_NIXL=1 PATH=/);
});
