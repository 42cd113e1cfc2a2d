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

// A worker killed (SIGKILL, OOM, a crash) cannot remove its directory, and on
// a memory file system what it left holds RAM until the machine reboots. Each
// directory names its PID namespace and process, so the next worker in the
// same parent can tell which were left by processes that are gone.

/** This PID namespace's id (the inode of /proc/self/ns/pid), or undefined where it cannot be read. */
function pidNamespace(): string | undefined {
  try {
    return String(fs.statSync('/proc/self/ns/pid').ino);
  } catch {
    return undefined;
  }
}

/** How the state directories of process `pid` (of this PID namespace) begin. */
export function stateDirPrefix(pid: number): string {
  return `nixl-node-kv-${pidNamespace() ?? 'na'}-${pid}-`;
}

function running(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM'; // it runs, as another user
  }
}

/**
 * Removes the state directories in `parent` of processes of this PID namespace
 * that no longer run. Never one whose process runs (a reused PID keeps it: the
 * safe side), of another namespace (a /dev/shm shared between containers), of
 * another name, nor anything but a directory (a link is not followed). Best effort: what cannot be read or removed stays.
 */
function sweepGone(parent: string): void {
  const ns = pidNamespace();
  if (ns === undefined) return;
  const mine = new RegExp(`^nixl-node-kv-${ns}-(\\d+)-`);
  let names: string[];
  try {
    names = fs.readdirSync(parent);
  } catch {
    return;
  }
  for (const name of names) {
    const pid = Number(mine.exec(name)?.[1]);
    if (!Number.isSafeInteger(pid) || pid <= 0 || pid === process.pid || running(pid)) continue;
    const dir = path.join(parent, name);
    try {
      // Only a directory, as a worker makes it: a file or a link of that name is someone else's.
      if (!fs.lstatSync(dir).isDirectory()) continue;
      fs.rmSync(dir, { recursive: true, force: true });
    } catch {
      // another worker removing it too, or not ours to remove: leave it
    }
  }
}

/**
 * A fresh directory of this worker's own under stateDirectory(dir), after
 * removing those of workers that are gone; NIXL_ERR_INVALID_PARAM when it
 * cannot be made.
 */
export function makeStateDir(dir?: string): string {
  const parent = stateDirectory(dir);
  sweepGone(parent);
  try {
    return fs.mkdtempSync(path.join(parent, stateDirPrefix(process.pid)));
  } catch (e) {
    throw new NixlError(
      `cannot make a state directory in ${parent}: ${(e as Error).message}`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }
}
