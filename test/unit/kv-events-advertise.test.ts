// What a worker that binds its KV-event publisher on a wildcard (tcp://*:P,
// 0.0.0.0, ::) advertises in /health and etcd: an address a consumer on
// another host can connect to, never the wildcard, also when the worker's own
// --host is a wildcard.
import * as os from 'node:os';
import { describe, expect, it } from 'vitest';
import { connectable } from '../../lib/serving/worker/kv-events/host';

const WILDCARD = /tcp:\/\/(0\.0\.0\.0|\*|\[::\]|::):/;

describe('advertised KV-event endpoint', () => {
  it("a wildcard bind is advertised at the worker's --host", () => {
    expect(connectable('tcp://0.0.0.0:5557', '10.1.2.3')).toBe('tcp://10.1.2.3:5557');
    expect(connectable('tcp://[::]:5557', 'fd00::7')).toBe('tcp://[fd00::7]:5557');
    expect(connectable('ipc:///run/kv.pub', '0.0.0.0')).toBe('ipc:///run/kv.pub');
  });

  it('a worker whose --host is a wildcard too advertises an interface address of the machine', () => {
    for (const host of ['0.0.0.0', '::', '*']) {
      const ep = connectable('tcp://0.0.0.0:5557', host);
      expect(ep).not.toMatch(WILDCARD);
      const h = ep.replace(/^tcp:\/\/\[?/, '').replace(/\]?:5557$/, '');
      const mine = Object.values(os.networkInterfaces())
        .flat()
        .map((i) => i?.address);
      expect([...mine, os.hostname(), process.env.VLLM_HOST_IP]).toContain(h);
    }
  });
});
