#!/usr/bin/env node
// The nixl-node command (cli/nixl-node.ts, compiled to dist/cli/).
'use strict';
require('../dist/cli/nixl-node.js');
