// Where a GGUF worker's state files go: node-llama-cpp saves and loads
// sequence states only through files, so they belong on a memory file system
// (/dev/shm) when there is one, or where the deployment says.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { modelPath } from '../../lib/serving/models/test-models';
import { startWorker } from '../../lib/serving';
import { MEMORY_FS, stateDirectory } from '../../lib/serving/models/state-dir';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-state-dir-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

const ours = (d: string) => fs.readdirSync(d).filter((f) => f.startsWith('nixl-node-kv-'));
const hasMemoryFs = (() => {
  try {
    fs.accessSync(MEMORY_FS, fs.constants.W_OK);
    return true;
  } catch {
    return false;
  }
})();

describe('state files', () => {
  it('the option wins, then NIXL_NODE_STATE_DIR, then /dev/shm where writable, then the OS temp dir', () => {
    expect(stateDirectory('/x', { NIXL_NODE_STATE_DIR: '/y' })).toBe('/x');
    expect(stateDirectory(undefined, { NIXL_NODE_STATE_DIR: '/y' })).toBe('/y');
    expect(stateDirectory(undefined, {})).toBe(hasMemoryFs ? MEMORY_FS : os.tmpdir());
  });

  it.runIf(hasMemoryFs)(
    'a worker with no option keeps its states on /dev/shm, and removes them at close',
    async () => {
      const saved = process.env.NIXL_NODE_STATE_DIR;
      delete process.env.NIXL_NODE_STATE_DIR;
      const before = new Set(ours(MEMORY_FS));
      try {
        const w = await startWorker({ model: modelPath('tiny', dir), contextSize: 256, threads: 1, blocks: 16 });
        const mine = ours(MEMORY_FS).filter((f) => !before.has(f));
        expect(mine).toHaveLength(1);
        await w.close();
        expect(fs.existsSync(path.join(MEMORY_FS, mine[0]))).toBe(false);
      } finally {
        if (saved !== undefined) process.env.NIXL_NODE_STATE_DIR = saved;
      }
    },
    60_000,
  );

  it('stateDir puts them elsewhere; one that cannot be made is NIXL_ERR_INVALID_PARAM, nothing started', async () => {
    const where = fs.mkdtempSync(path.join(dir, 'states-'));
    const w = await startWorker({
      model: modelPath('tiny', dir),
      stateDir: where,
      contextSize: 256,
      threads: 1,
      blocks: 16,
    });
    expect(ours(where)).toHaveLength(1);
    await w.close();
    expect(ours(where)).toHaveLength(0);
    await expect(
      startWorker({ model: modelPath('tiny', dir), stateDir: path.join(dir, 'missing', 'deeper'), blocks: 16 }),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
  }, 60_000);
});
