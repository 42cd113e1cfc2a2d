// A side-channel fetch's timeout must fire whatever the garbage collector does
// meanwhile. On Node 20 a timer signal that only AbortSignal.any() refers to
// is collected, and its timer with it: a silent peer then hangs the fetch for
// good. A full test run collects garbage at other moments than a run of one
// file, so this showed as a rare 30 s test timeout; here a collection is
// forced every few milliseconds while the fetch waits.
import * as net from 'node:net';
import * as v8 from 'node:v8';
import * as vm from 'node:vm';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createHandshake, type HandshakeServer } from '../../lib/handshake';
import { rankZeroPayload, within } from './handshake-helpers';

v8.setFlagsFromString('--expose-gc');
const gc = vm.runInNewContext('gc') as () => void;

/** Runs `f` with a full collection forced every 10 ms. */
async function underGc<T>(f: () => Promise<T>): Promise<T> {
  const iv = setInterval(gc, 10);
  try {
    gc();
    return await f();
  } finally {
    clearInterval(iv);
  }
}

let silent: net.Server;
let silentPort = 0;
const accepted = new Set<net.Socket>();

beforeAll(async () => {
  // Accepts and never answers (for ZeroMQ: never greets).
  silent = net.createServer((c) => {
    accepted.add(c);
    c.on('close', () => accepted.delete(c));
  });
  await new Promise<void>((r) => silent.listen(0, '127.0.0.1', () => r()));
  silentPort = (silent.address() as net.AddressInfo).port;
});

afterAll(async () => {
  // A fetch that hung keeps its connection: end them so close() returns.
  for (const c of accepted) c.destroy();
  await new Promise((r) => silent.close(r));
});

describe.each(['http', 'zmq'] as const)('%s side channel under garbage collection', (method) => {
  it('a silent peer times out with NIXL_ERR_TIMEOUT', async () => {
    const h = createHandshake(method);
    try {
      for (let i = 0; i < 3; i++) {
        const got = underGc(() =>
          h.fetch({ host: '127.0.0.1', port: silentPort, tpRank: 0, retries: 0, timeoutMs: 150 }),
        );
        await expect(within(got, 8000, `fetch ${i} from a silent peer`)).rejects.toMatchObject({
          code: 'NIXL_ERR_TIMEOUT',
        });
      }
    } finally {
      h.close();
    }
  });

  it("the caller's signal still cancels a fetch, and an unused signal leaves the timeout alone", async () => {
    const h = createHandshake(method);
    try {
      const ac = new AbortController();
      const got = underGc(() =>
        h.fetch({ host: '127.0.0.1', port: silentPort, tpRank: 0, retries: 5, timeoutMs: 60_000, signal: ac.signal }),
      );
      setTimeout(() => ac.abort(new Error('caller gave up')), 100);
      await expect(within(got, 8000, 'an aborted fetch')).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
      const kept = new AbortController();
      const late = underGc(() =>
        h.fetch({ host: '127.0.0.1', port: silentPort, tpRank: 0, retries: 0, timeoutMs: 150, signal: kept.signal }),
      );
      await expect(within(late, 8000, 'a fetch with a signal never aborted')).rejects.toMatchObject({
        code: 'NIXL_ERR_TIMEOUT',
      });
    } finally {
      h.close();
    }
  });

  it('a live server still answers, with a collection forced meanwhile', async () => {
    const h = createHandshake(method);
    const payloads = rankZeroPayload();
    const s: HandshakeServer = await h.serve({ port: 0, payloads, logger: { warn: () => {} } });
    try {
      const got = await underGc(() => h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0, timeoutMs: 5000 }));
      expect(got.metadata.agentMetadata.toString()).toBe('md');
    } finally {
      h.close();
      await s.close();
    }
  });
});
