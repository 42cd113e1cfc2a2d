// A proxy object starts once: start() again, or after close(), would listen a
// second server (or the same one again) that nothing closes.
import { describe, expect, it } from 'vitest';
import { ServingProxy } from '../../lib';

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
