// A GGUF worker killed (SIGKILL, OOM, a crash) cannot remove its state
// directory, and on /dev/shm what it left holds RAM until the machine
// reboots. A worker starting in the same parent removes the directories of
// workers that are gone: those of its own PID namespace whose process no
// longer runs; never one whose process runs, nor one of another namespace
// (a /dev/shm shared between containers) or of a name it did not make.
import { spawn, spawnSync } from 'node:child_process';
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

it("never follows a link named like a gone worker's directory, and removes only directories it could have made", () => {
  const p = fs.mkdtempSync(path.join(parent, 'links-'));
  const target = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-sweep-target-'));
  try {
    fs.writeFileSync(path.join(target, 'precious'), 'keep me');
    const link = path.join(p, `${stateDirPrefix(deadPid())}link01`);
    fs.symlinkSync(target, link);
    // A file (no worker makes one): someone else's, whatever its name.
    const file = path.join(p, `${stateDirPrefix(deadPid())}file01`);
    fs.writeFileSync(file, 'not a state directory');
    // A gone worker's directory holding a link out: the link goes, never what it points to.
    const gone = path.join(p, `${stateDirPrefix(deadPid())}gone01`);
    fs.mkdirSync(gone);
    fs.symlinkSync(target, path.join(gone, 'out'));
    // Extra dashes after the PID are the random part: still that PID's.
    const dashes = path.join(p, `${stateDirPrefix(deadPid())}a-b-c`);
    fs.mkdirSync(dashes);
    const mine = makeStateDir(p);
    expect(fs.readFileSync(path.join(target, 'precious'), 'utf8')).toBe('keep me');
    expect(fs.existsSync(gone)).toBe(false);
    expect(fs.existsSync(dashes)).toBe(false);
    expect(fs.existsSync(file)).toBe(true);
    expect(fs.lstatSync(link).isSymbolicLink()).toBe(true);
    expect(fs.existsSync(mine)).toBe(true);
  } finally {
    fs.rmSync(target, { recursive: true, force: true });
  }
});

it("never removes a running process's directory, and a parent that is not a directory is an error with a code", () => {
  const p = fs.mkdtempSync(path.join(parent, 'live-'));
  const child = spawn(process.execPath, ['-e', 'setTimeout(() => {}, 60000)'], { stdio: 'ignore' });
  try {
    const live = path.join(p, `${stateDirPrefix(child.pid!)}live01`);
    fs.mkdirSync(live);
    fs.writeFileSync(path.join(live, 'x.state'), 'in use');
    makeStateDir(p);
    expect(fs.readFileSync(path.join(live, 'x.state'), 'utf8')).toBe('in use');
  } finally {
    child.kill('SIGKILL');
  }
  // A parent that is a file: nothing to sweep, and the directory cannot be made.
  const notDir = path.join(p, 'plain-file');
  fs.writeFileSync(notDir, '');
  expect(() => makeStateDir(notDir)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
});

it('sweeps a parent of thousands of entries in well under a second of work per thousand', () => {
  const p = fs.mkdtempSync(path.join(parent, 'many-'));
  const dead = deadPid();
  for (let i = 0; i < 3000; i++) fs.writeFileSync(path.join(p, `other-${i}`), '');
  for (let i = 0; i < 1000; i++) fs.mkdirSync(path.join(p, `${stateDirPrefix(dead)}${String(i).padStart(6, '0')}`));
  const t0 = performance.now();
  makeStateDir(p);
  const ms = performance.now() - t0;
  expect(fs.readdirSync(p).filter((n) => n.startsWith(stateDirPrefix(dead)))).toEqual([]);
  expect(fs.readdirSync(p).length).toBe(3001);
  // Generous: a loaded 2-core machine; a sweep that stalls per entry takes far longer.
  expect(ms).toBeLessThan(10_000);
  console.log(`sweep of 4000 entries (1000 gone): ${ms.toFixed(0)} ms`);
});
