#!/usr/bin/env node
// Printed after every native build and by every install (scripts/install.js),
// prebuilt or built here: which engines the addon that loads has compiled in.
'use strict';
const fs = require('node:fs');
const path = require('node:path');

// The addon the package will load: a source build first, as node-gyp-build
// prefers it (asked directly: node-gyp-build reads PREBUILDS_ONLY once, when
// first required, and install.js set it to try the prebuild).
function loadAddon(root) {
  const built = path.join(root, 'build', 'Release', 'nixl_node.node');
  return fs.existsSync(built) ? require(built) : require('node-gyp-build')(root);
}

function reportEngines(root = path.join(__dirname, '..')) {
  const binding = loadAddon(root);
  console.log(`nixl-node: engines compiled in: ${binding.engines.join(', ')}`);
  if (!binding.engines.includes('nixl')) {
    console.log(
      'nixl-node: NIXL not found at build time (set NIXL_PREFIX to a NIXL install and rebuild for the nixl engine)',
    );
  }
}

if (require.main === module) reportEngines();
module.exports = { reportEngines };
