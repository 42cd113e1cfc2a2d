#!/usr/bin/env node
// Removes what tsc once emitted into dist/ for a source that is gone: tsc
// never deletes, and a stale dist/lib/x.js beside a new dist/lib/x/ folder
// is what require('./x') loads (a file before a folder's index), so a moved
// module would run its old code, and `npm pack` would ship it.
// Usage: node scripts/prune-dist.js [root] (default: this package's root).
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const OUTPUT = /\.(d\.ts\.map|d\.ts|js\.map|js)$/;

// Two test runs at once prune the same dist/: what the other one removed
// first is done, and a folder that tsc (the other run) has just written to
// again stays.
function tolerate(e, ...codes) {
  if (!['ENOENT', ...codes].includes(e.code)) throw e;
}

function prune(root) {
  const removed = [];
  const walk = (dir) => {
    let entries;
    try {
      entries = fs.readdirSync(dir, { withFileTypes: true });
    } catch (e) {
      return tolerate(e);
    }
    for (const e of entries) {
      const p = path.join(dir, e.name);
      if (e.isDirectory()) {
        walk(p);
        try {
          if (fs.readdirSync(p).length === 0) fs.rmdirSync(p);
        } catch (err) {
          tolerate(err, 'ENOTEMPTY');
        }
        continue;
      }
      const m = OUTPUT.exec(e.name);
      if (!m) continue;
      const rel = path.relative(path.join(root, 'dist'), p);
      const source = path.join(root, `${rel.slice(0, -m[0].length)}.ts`);
      if (fs.existsSync(source)) continue;
      try {
        fs.unlinkSync(p);
        removed.push(rel);
      } catch (err) {
        tolerate(err);
      }
    }
  };
  if (fs.existsSync(path.join(root, 'dist'))) walk(path.join(root, 'dist'));
  return removed;
}

module.exports = { prune };

if (require.main === module) {
  const removed = prune(path.resolve(process.argv[2] ?? path.join(__dirname, '..')));
  if (removed.length) console.log(`prune-dist: removed ${removed.length} stale file(s) from dist/`);
}
