// A handshake fetch aborted while it pauses between attempts settles at once
// with NIXL_ERR_CANCELED, on both side channels: the pause (50 ms doubling to
// 1 s) is cut short by the caller's signal, not sat out.
import { describe, expect, it } from 'vitest';
import { type HandshakeMethod, createHandshake } from '../../lib/handshake';
import { freePort } from '../helpers';

describe.each(['http', 'zmq'] as HandshakeMethod[])('%s side channel: an abort between attempts', (method) => {
  it('settles within a fraction of the pause it fell in', async () => {
    // Nobody listens: each attempt fails (refused, or its 50 ms timeout), and
    // by 2 s in the pauses last a second each.
    const port = await freePort();
    const hs = createHandshake(method);
    const ac = new AbortController();
    try {
      const got = hs.fetch({ host: '127.0.0.1', port, tpRank: 0, retries: 30, timeoutMs: 50, signal: ac.signal }).then(
        () => 'answered',
        (e) => e,
      );
      await new Promise((r) => setTimeout(r, 2000));
      const t0 = performance.now();
      ac.abort(new Error('caller gave up'));
      const err = await got;
      const lateMs = performance.now() - t0;
      expect(err).toMatchObject({ code: 'NIXL_ERR_CANCELED' });
      // Before, it settled when the pause ended: 550-850 ms after the abort here.
      expect(lateMs).toBeLessThan(400);
    } finally {
      hs.close();
    }
  }, 20_000);
});
