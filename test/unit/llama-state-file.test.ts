// The state files and buffers a GGUF worker moves every state through
// (lib/serving/models/llama/state-file.ts, state-buffers.ts): whole buffers
// of every size a state has, byte for byte; a file written over a longer one
// holds exactly the new bytes; a missing file is an error, not an empty
// state; and a lent buffer is lent to one holder at a time.
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { StateBuffers } from '../../lib/serving/models/llama/state-buffers';
import { readInto, writeOver } from '../../lib/serving/models/llama/state-file';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'state-file-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

it('writes and reads back whole buffers, byte for byte, from empty to megabytes', () => {
  const buffers = new StateBuffers(2);
  for (const size of [0, 1, 512 * 1024 + 3, 10 * 1024 * 1024 + 17]) {
    const file = path.join(dir, `s${size}`);
    const data = randomBytes(size);
    writeOver(file, data);
    expect(fs.statSync(file).size).toBe(size);
    const got = readInto(file, buffers);
    expect(got.equals(data)).toBe(true);
    expect(fs.readFileSync(file).equals(data)).toBe(true);
    buffers.give(got);
  }
  expect(buffers.lent).toBe(0);
});

it('writes over a file in place: a shorter state leaves none of the longer one; a missing file is ENOENT', () => {
  const buffers = new StateBuffers(1);
  const file = path.join(dir, 'shrink');
  writeOver(file, Buffer.alloc(1 << 20, 1));
  const inode = fs.statSync(file).ino;
  writeOver(file, Buffer.from('short'));
  expect(fs.statSync(file).ino).toBe(inode);
  const got = readInto(file, buffers);
  expect(got.toString()).toBe('short');
  buffers.give(got);
  writeOver(file, Buffer.alloc(3 << 20, 2));
  expect(fs.readFileSync(file).equals(Buffer.alloc(3 << 20, 2))).toBe(true);
  expect(() => readInto(path.join(dir, 'absent'), buffers)).toThrow(expect.objectContaining({ code: 'ENOENT' }));
  expect(buffers.lent).toBe(0);
});

it('lends a buffer to one holder at a time: given back, it is used again; a second give or a foreign buffer is ignored', () => {
  const buffers = new StateBuffers(2);
  const a = buffers.take(3000);
  const b = buffers.take(3000);
  expect(a.length).toBe(3000);
  expect(a.buffer).not.toBe(b.buffer);
  buffers.give(a);
  buffers.give(a); // twice: must not be lent to two holders
  buffers.give(Buffer.alloc(3000)); // not one of ours
  buffers.give(b.subarray(1)); // not the lent view
  expect(buffers.lent).toBe(1);
  const c = buffers.take(2000);
  const d = buffers.take(2000);
  expect(c.buffer).toBe(a.buffer);
  expect(d.buffer).not.toBe(a.buffer);
  expect(d.buffer).not.toBe(b.buffer);
  // A bigger one than any free: a new buffer.
  for (const x of [b, c, d]) buffers.give(x);
  expect(buffers.lent).toBe(0);
  const big = buffers.take(5 << 20);
  expect(big.length).toBe(5 << 20);
  expect([b.buffer, c.buffer, d.buffer]).not.toContain(big.buffer);
  buffers.give(big);
});
