// scripts/prebuild-arm64.sh (run by prepack) on a host without the aarch64 cross
// compiler: the tarball must be x64 only, not ship a linux-arm64 prebuild left
// over from an earlier pack (prebuildify rewrites only the arch it builds).
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { ROOT } from '../helpers';

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-prebuild-arm64-'));
afterAll(() => fs.rmSync(tmp, { recursive: true, force: true }));

function which(cmd: string): string {
  return spawnSync('bash', ['-c', `command -v ${cmd}`], { encoding: 'utf8' }).stdout.trim();
}

it('without aarch64-linux-gnu-g++ it says so, succeeds, and leaves no stale linux-arm64 prebuild', () => {
  const tree = path.join(tmp, 'pkg');
  fs.mkdirSync(path.join(tree, 'scripts'), { recursive: true });
  fs.copyFileSync(path.join(ROOT, 'scripts/prebuild-arm64.sh'), path.join(tree, 'scripts/prebuild-arm64.sh'));
  const stale = path.join(tree, 'prebuilds/linux-arm64');
  fs.mkdirSync(stale, { recursive: true });
  fs.writeFileSync(path.join(stale, 'nixl-node.node'), 'an arm64 addon from an earlier pack');
  fs.mkdirSync(path.join(tree, 'prebuilds/linux-x64'));
  // A PATH with the script's ordinary tools and no cross compiler.
  const bin = path.join(tmp, 'bin');
  fs.mkdirSync(bin);
  for (const cmd of ['dirname', 'rm']) fs.symlinkSync(which(cmd), path.join(bin, cmd));
  const r = spawnSync(which('bash'), [path.join(tree, 'scripts/prebuild-arm64.sh')], {
    encoding: 'utf8',
    env: { PATH: bin },
  });
  expect(r.status, r.stderr).toBe(0);
  expect(r.stderr).toContain('aarch64-linux-gnu-g++ not found');
  expect(fs.existsSync(stale)).toBe(false);
  expect(fs.existsSync(path.join(tree, 'prebuilds/linux-x64'))).toBe(true);
});
