// A proxy object starts once: start() again, or after close(), would listen a
// second server (or the same one again) that nothing closes.
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import { describe, expect, it } from 'vitest';
import { ServingProxy, startProxy } from '../../lib';
import { modelPath } from '../../lib/serving/models/test-models';

const options = { prefill: ['http://127.0.0.1:9'], decode: ['http://127.0.0.1:9'], healthIntervalMs: 0 };

describe('ServingProxy lifecycle', () => {
  it('start() after close() is refused (NIXL_ERR_NOT_ALLOWED) and nothing listens', async () => {
    const p = new ServingProxy(options);
    await p.start();
    const url = p.url;
    await p.close();
    await expect(p.start()).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_ALLOWED' });
    await expect(fetch(`${url}/health`)).rejects.toThrow();
    await p.close(); // a second close is a no-op
  });

  it('start() twice is refused, and the first start still serves', async () => {
    const p = new ServingProxy(options);
    await p.start();
    try {
      await expect(p.start()).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_ALLOWED' });
      expect((await fetch(`${p.url}/v1/models`)).status).toBe(200);
    } finally {
      await p.close();
    }
  });
});

/** A TCP server that takes connections and never answers (a worker whose health check hangs). */
async function silentPeer(): Promise<{ url: string; close(): Promise<void> }> {
  const sockets = new Set<net.Socket>();
  const srv = net.createServer((s) => {
    sockets.add(s);
    s.on('error', () => {});
  });
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', () => r()));
  return {
    url: `http://127.0.0.1:${(srv.address() as AddressInfo).port}`,
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise((r) => srv.close(r));
    },
  };
}

describe('ServingProxy closed while it starts', () => {
  it('close() before start() resolves: the start is cancelled and nothing listens', async () => {
    const p = new ServingProxy(options);
    const started = p.start();
    const closed = p.close();
    await expect(started).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
    await closed;
    expect(p.url).toBe('');
  });

  it('close() during the first health round: start() rejects, close() waits for it, nothing listens after', async () => {
    const peer = await silentPeer();
    try {
      const p = new ServingProxy({ prefill: [peer.url], decode: [peer.url], healthIntervalMs: 60_000 });
      const started = p.start();
      // Wait until it listens (the first health round then hangs on the silent peer).
      for (let i = 0; i < 200 && p.url === ''; i++) await new Promise((r) => setTimeout(r, 5));
      expect(p.url).not.toBe('');
      const url = p.url;
      await p.close();
      await expect(started).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
      await expect(fetch(`${url}/health`)).rejects.toThrow();
    } finally {
      await peer.close();
    }
  });

  it('close() while the GGUF vocabulary loads: start() rejects and nothing listens', async () => {
    const p = new ServingProxy({ ...options, policy: 'precise', kvEvents: { tokenizer: { gguf: modelPath('tiny') } } });
    const started = p.start();
    await new Promise((r) => setTimeout(r, 20));
    await p.close();
    await expect(started).rejects.toMatchObject({ code: 'NIXL_ERR_CANCELED' });
    expect(p.url).toBe('');
  }, 60_000);

  it('startProxy: a port in use fails the start with its error and leaves nothing behind', async () => {
    const a = await startProxy(options);
    try {
      const port = Number(new URL(a.url).port);
      await expect(startProxy({ ...options, port })).rejects.toMatchObject({ code: 'EADDRINUSE' });
      expect((await fetch(`${a.url}/v1/models`)).status).toBe(200);
    } finally {
      await a.close();
    }
  });
});
