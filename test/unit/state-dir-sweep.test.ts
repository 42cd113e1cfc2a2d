// A GGUF worker killed (SIGKILL, OOM, a crash) cannot remove its state
// directory, and on /dev/shm what it left holds RAM until the machine
// reboots. A worker starting in the same parent removes the directories of
// workers that are gone: those of its own PID namespace whose process no
// longer runs; never one whose process runs, nor one of another namespace
// (a /dev/shm shared between containers) or of a name it did not make.
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { makeStateDir, stateDirPrefix } from '../../lib/serving/models/state-dir';

const parent = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-sweep-'));
afterAll(() => fs.rmSync(parent, { recursive: true, force: true }));

/** The PID of a process that has exited. */
function deadPid(): number {
  const r = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))']);
  return Number(r.stdout.toString());
}

it("a worker's state directory names its process, and one of a process gone is removed by the next", () => {
  const first = makeStateDir(parent);
  expect(path.basename(first).startsWith(stateDirPrefix(process.pid))).toBe(true);
  const gone = path.join(parent, `${stateDirPrefix(deadPid())}abc123`);
  fs.mkdirSync(gone);
  fs.writeFileSync(path.join(gone, 'x.state'), Buffer.alloc(1 << 20));
  const otherNs = path.join(parent, `nixl-node-kv-ns1-${deadPid()}-abc123`);
  fs.mkdirSync(otherNs);
  const oldName = path.join(parent, 'nixl-node-kv-AbC123');
  fs.mkdirSync(oldName);
  const second = makeStateDir(parent);
  expect(fs.existsSync(gone)).toBe(false);
  // Kept: this process's own (it runs), another namespace's, a name of another form.
  for (const kept of [first, second, otherNs, oldName]) expect(fs.existsSync(kept), kept).toBe(true);
});
