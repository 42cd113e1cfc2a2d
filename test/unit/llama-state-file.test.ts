// The state files a GGUF worker moves every state through
// (lib/serving/models/llama/state-file.ts): whole buffers, of every size a
// state has (bigger than the 512 KiB pieces of fs.promises.readFile), byte
// for byte, and a file that is not there is an error, not an empty state.
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { readWhole, writeWhole } from '../../lib/serving/models/llama/state-file';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'state-file-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

it('writes and reads back whole buffers, byte for byte, from empty to megabytes', async () => {
  for (const size of [0, 1, 512 * 1024 + 3, 10 * 1024 * 1024 + 17]) {
    const file = path.join(dir, `s${size}`);
    const data = randomBytes(size);
    await writeWhole(file, data);
    expect(fs.statSync(file).size).toBe(size);
    expect((await readWhole(file)).equals(data)).toBe(true);
    expect(fs.readFileSync(file).equals(data)).toBe(true);
  }
});

it('replaces a longer file wholly, and a missing file is an ENOENT error', async () => {
  const file = path.join(dir, 'shrink');
  await writeWhole(file, Buffer.alloc(4096, 1));
  await writeWhole(file, Buffer.from('short'));
  expect((await readWhole(file)).toString()).toBe('short');
  await expect(readWhole(path.join(dir, 'absent'))).rejects.toMatchObject({ code: 'ENOENT' });
});
