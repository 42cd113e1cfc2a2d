// Writes the seed corpora of the fuzz targets (committed; rerun after a
// metadata format change): node test/fuzz/make-seeds.js
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const { NixlAgent, allocate } = require(path.join(__dirname, '..', '..', 'dist', 'lib'));

const dir = (t) => path.join(__dirname, 'corpus', t);
const a = new NixlAgent('seed-agent-é', { engine: 'loopback' });
const mem = [allocate(8192), Buffer.alloc(4096), Buffer.alloc(65536)];
const write = (t, name, buf) => fs.writeFileSync(path.join(dir(t), name), buf);
write('metadata', 'empty-agent.bin', a.getAgentMetadata());
a.registerMemory(mem[0]);
write('metadata', 'one-shared-region.bin', a.getAgentMetadata());
a.registerMemory([mem[1], mem[2]]);
write('metadata', 'three-regions.bin', a.getAgentMetadata());
write('metadata', 'partial-no-conn.bin', a.getPartialAgentMetadata(mem[1]));
write('metadata', 'partial-conn.bin', a.getPartialAgentMetadata(mem[2], { includeConnInfo: true }));
a.close();

// Descriptor inputs: op, count, then per pair (local, remote) a selector byte,
// an int16 offset and a uint16 length (+ int64 / uint64 when the selector's
// high bits say so). See fuzz_descriptors.cpp.
const pair = (sel, off, len) => {
  const b = Buffer.alloc(5);
  b[0] = sel;
  b.writeInt16LE(off, 1);
  b.writeUInt16LE(len, 3);
  return b;
};
write('descriptors', 'read-inside.bin', Buffer.concat([Buffer.from([0, 0]), pair(0, 0, 4096), pair(1, 0, 4096)]));
write(
  'descriptors',
  'write-two.bin',
  Buffer.concat([Buffer.from([1, 1]), pair(0, 16, 100), pair(0, 200, 100), pair(1, 4000, 96), pair(1, 0, 96)]),
);
write('descriptors', 'one-past-end.bin', Buffer.concat([Buffer.from([0, 0]), pair(0, 1, 4096), pair(0, 0, 4096)]));
write('descriptors', 'before-start.bin', Buffer.concat([Buffer.from([0, 0]), pair(0, -8, 16), pair(0, 0, 16)]));
const wrap = Buffer.alloc(13);
wrap[0] = 0x40; // 64-bit length
wrap.writeInt16LE(16, 1);
wrap.writeBigUInt64LE((1n << 64n) - 8n, 3);
write('descriptors', 'wrapping-length.bin', Buffer.concat([Buffer.from([0, 0]), wrap, pair(0, 0, 16)]));
write('descriptors', 'device-1.bin', Buffer.concat([Buffer.from([0, 0]), pair(0x20, 0, 64), pair(0, 0, 64)]));
