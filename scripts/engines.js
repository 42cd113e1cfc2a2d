#!/usr/bin/env node
// Printed after every native build: which engines this addon was compiled with.
'use strict';
const path = require('node:path');
const binding = require('node-gyp-build')(path.join(__dirname, '..'));
const engines = binding.engines.join(', ');
console.log(`nixl-node: engines compiled in: ${engines}`);
if (!binding.engines.includes('nixl')) {
  console.log(
    'nixl-node: NIXL not found at build time (set NIXL_PREFIX to a NIXL install and rebuild for the nixl engine)',
  );
}
