// The process exits when its agents are idle and stays alive while a transfer
// is in flight or a notification is awaited.
import { fork } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { NixlAgent } from '../../lib';
import { FIXTURES } from '../helpers';

function run(mode: string) {
  const p = fork(path.join(FIXTURES, 'lifecycle.js'), [mode], { stdio: ['ignore', 'pipe', 'pipe', 'ipc'] });
  let out = '';
  p.stdout!.on('data', (d) => (out += d));
  p.stderr!.on('data', (d) => (out += d));
  const exited = once(p, 'exit').then(([code]) => ({ code: code as number, out }));
  return { p, exited };
}

it.each([
  ['an idle agent does not keep the process alive', 'idle'],
  ['a transfer in flight keeps the process alive until it completes', 'inflight'],
])('%s', async (_title, mode) => {
  const { p, exited } = run(mode);
  const t = setTimeout(() => p.kill('SIGKILL'), 20_000);
  const r = await exited;
  clearTimeout(t);
  expect(r.code).toBe(0); // exited by itself (a kill would show as null)
  expect(r.out).toContain('done');
});

it('waiting for a notification keeps the process alive until it arrives', async () => {
  const { p, exited } = run('notif');
  const [msg] = (await once(p, 'message')) as [{ md: Uint8Array }];
  const me = new NixlAgent('life-sender', { engine: 'loopback' });
  try {
    me.addRemoteAgent(Buffer.from(msg.md));
    await new Promise((r) => setTimeout(r, 500));
    expect(p.exitCode).toBe(null); // still waiting
    me.sendNotif('life-a', 'go');
    const r = await exited;
    expect(r.code).toBe(0);
    expect(r.out).toContain('got go from life-sender');
  } finally {
    me.close();
    if (p.exitCode === null) p.kill('SIGKILL');
  }
});
