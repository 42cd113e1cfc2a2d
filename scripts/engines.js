#!/usr/bin/env node
// Printed after every native build and by every install (scripts/install.js),
// prebuilt or built here: which engines the addon that loads has compiled in.
'use strict';
const path = require('node:path');

function reportEngines(root = path.join(__dirname, '..')) {
  const binding = require('node-gyp-build')(root);
  console.log(`nixl-node: engines compiled in: ${binding.engines.join(', ')}`);
  if (!binding.engines.includes('nixl')) {
    console.log(
      'nixl-node: NIXL not found at build time (set NIXL_PREFIX to a NIXL install and rebuild for the nixl engine)',
    );
  }
}

if (require.main === module) reportEngines();
module.exports = { reportEngines };
