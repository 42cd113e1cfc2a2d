#!/usr/bin/env node
// Finds an installed NIXL for the build: NIXL_PREFIX, else /opt/nvidia/nvda_nixl.
// binding.gyp and CMakeLists.txt ask it one thing at a time:
//   found   -> 1 | 0
//   include -> <prefix>/include
//   libdir  -> the directory holding libnixl.so (lib/x86_64-linux-gnu or lib64 or lib)
// It only looks; it never fetches or builds NIXL. NIXL_NODE_NO_NIXL=1 makes it
// find nothing: prebuilds are built so, since a prebuild linked against one
// machine's libnixl would not load where that library is absent (NIXL users
// build from source at install).
'use strict';
const fs = require('node:fs');
const path = require('node:path');

function find() {
  if (process.env.NIXL_NODE_NO_NIXL === '1') return undefined;
  const candidates = [process.env.NIXL_PREFIX, '/opt/nvidia/nvda_nixl'].filter(Boolean);
  for (const prefix of candidates) {
    const include = path.join(prefix, 'include');
    if (!fs.existsSync(path.join(include, 'nixl.h'))) continue;
    const arch = process.arch === 'arm64' ? 'aarch64-linux-gnu' : 'x86_64-linux-gnu';
    for (const lib of [path.join('lib', arch), 'lib64', 'lib']) {
      const libdir = path.join(prefix, lib);
      if (fs.existsSync(path.join(libdir, 'libnixl.so'))) return { prefix, include, libdir };
    }
  }
  return undefined;
}

if (require.main === module) {
  const what = process.argv[2] || 'found';
  const nixl = find();
  if (what === 'found') process.stdout.write(nixl ? '1' : '0');
  else if (!nixl) process.stdout.write('');
  else process.stdout.write(nixl[what] ?? '');
}
module.exports = { find };
