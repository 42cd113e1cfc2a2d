// The native baseline: bench/native/nixl_read.cpp, a C++ program that moves
// the same bytes as the binding on the installed NIXL, built once per source
// change under the OS temp folder. The bench and the demo both run it; it
// lives here, below both, so neither imports the other. Not a public export.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { engines } from './agent';

// lib/ and dist/lib/ both resolve the package root two or one levels up.
function packageRoot(): string {
  const up1 = path.join(__dirname, '..');
  return path.basename(up1) === 'dist' ? path.join(up1, '..') : up1;
}

/** The native program, built once per source change; or why it cannot be. */
export function nativeProgram(): { path: string } | { skip: string } {
  if (!engines.includes('nixl')) return { skip: 'NIXL is not compiled in (build with NIXL_PREFIX=<nixl install>)' };
  const root = packageRoot();
  const find = (what: string) =>
    execFileSync(process.execPath, [path.join(root, 'scripts', 'find-nixl.js'), what], { encoding: 'utf8' });
  if (find('found') !== '1') return { skip: 'no installed NIXL found (NIXL_PREFIX, /opt/nvidia/nvda_nixl)' };
  const src = path.join(root, 'bench', 'native', 'nixl_read.cpp');
  const dir = path.join(os.tmpdir(), 'nixl-node-bench');
  const out = path.join(dir, `nixl_read-${fs.statSync(src).mtimeMs.toFixed(0)}`);
  if (!fs.existsSync(out)) {
    fs.mkdirSync(dir, { recursive: true });
    const libdir = find('libdir');
    execFileSync(
      'g++',
      [
        '-O2',
        '-std=c++20',
        `-I${find('include')}`,
        src,
        `-L${libdir}`,
        `-Wl,-rpath,${libdir}`,
        '-lnixl',
        '-lnixl_build',
        '-lserdes',
        '-o',
        out,
      ],
      { stdio: ['ignore', 'ignore', 'inherit'] },
    );
  }
  return { path: out };
}
