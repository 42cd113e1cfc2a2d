// The test helpers' own promises: a child process that fails to start fails
// the test at once with its own error (what it printed), not with a 15 s
// 'peer did not answer'; a port taken between the check and the bind is
// retried on another.
import * as net from 'node:net';
import { expect, it } from 'vitest';
import { Peer, onFreePort } from '../helpers';

it('a peer that dies before answering rejects next() with its exit and stderr', async () => {
  const t0 = performance.now();
  const peer = new Peer('no-such-fixture.js');
  const err = await peer.next().catch((e: Error) => e);
  expect(err).toBeInstanceOf(Error);
  expect((err as Error).message).toMatch(/exited \(code 1\) before answering/);
  expect((err as Error).message).toMatch(/Cannot find module/);
  expect(performance.now() - t0).toBeLessThan(5000);
  // Asking again, or sending to it, says the same and throws nothing else.
  peer.send({ op: 'anything' });
  await expect(peer.next()).rejects.toThrow(/before answering/);
});

it('onFreePort binds again on another port when the one it was given is taken meanwhile', async () => {
  const squatters: net.Server[] = [];
  const tried: number[] = [];
  const got = await onFreePort(async (port) => {
    tried.push(port);
    if (tried.length === 1) {
      // Someone takes it between the check and our bind.
      const sq = net.createServer();
      await new Promise<void>((r) => sq.listen(port, '127.0.0.1', () => r()));
      squatters.push(sq);
    }
    const s = net.createServer();
    await new Promise<void>((resolve, reject) => {
      s.once('error', reject);
      s.listen(port, '127.0.0.1', () => resolve());
    });
    return s;
  });
  expect(tried.length).toBe(2);
  expect((got.address() as net.AddressInfo).port).toBe(tried[1]);
  for (const s of [got, ...squatters]) s.close();
  await expect(onFreePort(() => Promise.reject(new Error('something else')))).rejects.toThrow('something else');
});
