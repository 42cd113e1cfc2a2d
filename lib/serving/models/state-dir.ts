// Where a GGUF worker's sequence states go through files: node-llama-cpp
// saves and loads states only through files, so each prefill writes one and
// each decode reads one. On a memory file system that costs a copy in RAM
// instead of a write to and a read from disk.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { NixlError } from '../../errors';

/** The default memory file system (Linux). */
export const MEMORY_FS = '/dev/shm';

/**
 * The directory for state files: `dir` when given, else NIXL_NODE_STATE_DIR,
 * else /dev/shm where it is a writable directory, else the OS temp dir.
 */
export function stateDirectory(dir?: string, env: NodeJS.ProcessEnv = process.env): string {
  const chosen = dir ?? env.NIXL_NODE_STATE_DIR;
  if (chosen !== undefined && chosen !== '') return chosen;
  try {
    fs.accessSync(MEMORY_FS, fs.constants.W_OK | fs.constants.X_OK);
    if (fs.statSync(MEMORY_FS).isDirectory()) return MEMORY_FS;
  } catch {
    // no memory file system here
  }
  return os.tmpdir();
}

/** A fresh directory of this worker's own under stateDirectory(dir); NIXL_ERR_INVALID_PARAM when it cannot be made. */
export function makeStateDir(dir?: string): string {
  const parent = stateDirectory(dir);
  try {
    return fs.mkdtempSync(path.join(parent, 'nixl-node-kv-'));
  } catch (e) {
    throw new NixlError(
      `cannot make a state directory in ${parent}: ${(e as Error).message}`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }
}
