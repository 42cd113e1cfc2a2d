// What a NIXL agent writes to stderr as it starts. NIXL logs an error for
// every getNotifs made while the agent has no backend, and the engine's poll
// thread starts before NixlAgent's constructor creates the UCX backend: every
// process on NIXL then began with `getNotifs: no backends support
// notifications`. Skipped without an addon built against NIXL.
import { spawnSync } from 'node:child_process';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { engines } from '../../lib';
import { ROOT } from '../helpers';

// Starts an agent, lets its poll thread run through its first idle waits (1, 2, 4, 8 ms...), makes a
// second agent with no backend at all, and closes both: none of it may log the error.
const SCRIPT = `
const { NixlAgent } = require(${JSON.stringify(path.join(ROOT, 'dist', 'lib'))});
const a = new NixlAgent('start-log-a', { engine: 'nixl' });
const none = new NixlAgent('start-log-none', { engine: 'nixl', backends: [] });
setTimeout(() => {
  console.log('backends', a.getBackends().join(','), 'notifs', a.getNewNotifs().size, none.getBackends().length);
  a.close();
  none.close();
}, 300);
`;

it.skipIf(!engines.includes('nixl'))(
  'a NIXL agent starts without "no backends support notifications" on stderr',
  () => {
    const r = spawnSync(process.execPath, ['-e', SCRIPT], { encoding: 'utf8', timeout: 60_000 });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toContain('backends UCX notifs 0 0');
    expect(r.stderr).not.toMatch(/no backends support notifications/);
  },
  90_000,
);
