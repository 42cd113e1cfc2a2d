#!/usr/bin/env node
// npm install hook. A prebuilt addon (prebuilds/, loopback engine) is used when
// it loads here and no NIXL is installed: nothing is compiled. With NIXL found
// (NIXL_PREFIX, else /opt/nvidia/nvda_nixl), or no loadable prebuild, the addon
// is built from source with node-gyp, and the log says which and why.
'use strict';
const { execFileSync, spawnSync } = require('node:child_process');
const path = require('node:path');

const root = path.join(__dirname, '..');
const nixl = execFileSync(process.execPath, [path.join(__dirname, 'find-nixl.js'), 'found'], { encoding: 'utf8' });

function buildFromSource(why) {
  console.log(`nixl-node: building the addon from source: ${why}`);
  // npm hands install scripts the path of its own node-gyp.
  const gyp = process.env.npm_config_node_gyp;
  const cmd = gyp ? [process.execPath, [gyp, 'rebuild']] : ['node-gyp', ['rebuild']];
  const r = spawnSync(cmd[0], cmd[1], { cwd: root, stdio: 'inherit' });
  if (r.status !== 0) {
    console.error(
      'nixl-node: the source build failed; it needs a C++20 compiler (g++ 10+), make and python3 (node-gyp): see README.md#install',
    );
    process.exit(r.status ?? 1);
  }
}

if (nixl === '1') {
  const prefix = execFileSync(process.execPath, [path.join(__dirname, 'find-nixl.js'), 'include'], {
    encoding: 'utf8',
  });
  buildFromSource(`NIXL found (${path.dirname(prefix)}), so the nixl engine is compiled in`);
} else {
  let loaded;
  try {
    process.env.PREBUILDS_ONLY = '1';
    const load = require('node-gyp-build');
    loaded = load.path(root);
    load(root);
  } catch (e) {
    buildFromSource(`no prebuilt addon loads on ${process.platform}-${process.arch} (${e.message.split('\n')[0]})`);
    loaded = undefined;
  }
  if (loaded)
    console.log(
      `nixl-node: using the prebuilt addon ${path.relative(root, loaded)} (loopback engine; set NIXL_PREFIX and reinstall for NIXL)`,
    );
}
// The line docs/nixl.md tells users to look for, on every path (as npm run build prints it).
require('./engines.js').reportEngines(root);
