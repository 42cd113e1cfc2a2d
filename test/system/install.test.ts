// The install prints what the README says to look for, on every path: after a
// source build, node-gyp-build has already been loaded with PREBUILDS_ONLY set
// (install.js tried the prebuild first) and reads that flag only once.
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { ROOT } from '../helpers';

it.skipIf(!fs.existsSync(path.join(ROOT, 'build', 'Release', 'nixl_node.node')))(
  'after a source build, the engines line is printed even though the prebuild was tried first',
  () => {
    const script = `
      process.env.PREBUILDS_ONLY = '1';
      try { require('node-gyp-build')(process.cwd() + '/no-such-dir'); } catch {}
      require('./scripts/engines.js').reportEngines(process.cwd());
    `;
    const r = spawnSync(process.execPath, ['-e', script], { cwd: ROOT, encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^nixl-node: engines compiled in: loopback/m);
  },
);
