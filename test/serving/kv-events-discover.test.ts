// The proxy follows the KV events every prefill advertises, with no
// --kv-events-endpoint: static workers through their /health answer, fleet
// workers through their etcd record; a worker that leaves takes its
// subscription and its index with it. A second prompt with the same long
// prefix goes to the prefill whose events say it holds it.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { type Worker, startProxy, startWorker } from '../../lib/serving';
import { ETCD_MISSING, EtcdServer } from '../etcd-server';
import { complete, etcdFleet } from './kv-routing-helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-kv-discover-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));
const events = (name: string) => ({
  enable_kv_cache_events: true,
  endpoint: `ipc://${dir}/${name}-pub`,
  replay_endpoint: `ipc://${dir}/${name}-replay`,
});

async function until(what: () => boolean, ms = 10_000): Promise<boolean> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) return false;
    await new Promise((r) => setTimeout(r, 20));
  }
  return true;
}

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

// Long enough for several 16-token blocks; the tail differs, the prefix is shared.
const PREFIX = 'You are a careful assistant. Answer in one short sentence, and be exact about it. '.repeat(2);

describe('precise routing follows the publishers the prefills advertise', () => {
  it('static workers: found through /health, and a shared prefix goes back to the prefill that holds it', async () => {
    const a = await startWorker({ transport: 'http', kvEvents: events('sa') });
    // A wildcard bind: its /health names an address the proxy can connect to.
    const b = await startWorker({
      transport: 'http',
      kvEvents: { enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0' },
    });
    const d = await startWorker({ transport: 'http' });
    closers.push(
      () => a.close(),
      () => b.close(),
      () => d.close(),
    );
    const proxy = await startProxy({
      transport: 'http',
      prefill: [a.address, b.address],
      decode: [d.address],
      policy: 'precise',
      // No speculative entry: only the events can say where the prefix is.
      kvEvents: { index: { speculativeTtlMs: 1 } },
    });
    closers.push(() => proxy.close());
    const routing = proxy.kvRouting!;
    const first = await complete(proxy, `${PREFIX}What is 2 + 2?`);
    const holder = first.nixl_node.prefill;
    expect([a.address, b.address]).toContain(holder);
    await until(() => routing.index.workers.includes(holder) && routing.index.size > 0);
    for (const q of ['What is 3 + 5?', 'Name a colour.', 'What is 7 * 6?']) {
      const ans = await complete(proxy, `${PREFIX}${q}`);
      expect(ans.nixl_node.prefill).toBe(holder);
      expect(ans.nixl_node.prefix_match_tokens).toBeGreaterThanOrEqual(64);
    }
    expect(routing.follower.names.sort()).toEqual([a.address, b.address].sort());
    expect(routing.stats.applied).toBeGreaterThan(0);
  });

  it('--kv-events-endpoint wins over what the worker advertises', async () => {
    const a = await startWorker({ transport: 'http', kvEvents: events('xa') });
    const d = await startWorker({ transport: 'http' });
    closers.push(
      () => a.close(),
      () => d.close(),
    );
    const proxy = await startProxy({
      transport: 'http',
      prefill: [a.address],
      decode: [d.address],
      policy: 'precise',
      kvEvents: { endpoints: { [a.address]: { pub: `ipc://${dir}/nobody-pub` } } },
    });
    closers.push(() => proxy.close());
    await complete(proxy, `${PREFIX}What is 2 + 2?`);
    expect(proxy.pools.prefill.workers[0].kvEvents?.endpoint).toBe(`ipc://${dir}/xa-pub`);
    expect(proxy.kvRouting!.follower.names).toEqual([]);
  });
});

describe.skipIf(ETCD_MISSING !== '')(`precise routing over a fleet in etcd${ETCD_MISSING}`, () => {
  it('a worker registering kv_events is followed; one leaving takes its subscription and index along', async () => {
    const etcd = await new EtcdServer().start();
    closers.push(() => etcd.destroy());
    const { role: fleet, proxy: fleetProxy } = etcdFleet(etcd.url, '/kv-discover/');
    const a = await startWorker({ name: 'pa', blocks: 64, kvEvents: events('ea'), etcd: fleet('prefill') });
    const b = await startWorker({ name: 'pb', blocks: 64, kvEvents: events('eb'), etcd: fleet('prefill') });
    const d = await startWorker({ name: 'dd', blocks: 64, etcd: fleet('decode') });
    const closed = new Set<Worker>();
    const closeOnce = async (w: Worker) => {
      if (closed.has(w)) return;
      closed.add(w);
      await w.close();
    };
    closers.push(
      () => closeOnce(a),
      () => closeOnce(b),
      () => d.close(),
    );
    const proxy = await fleetProxy();
    closers.push(() => proxy.close());
    const routing = proxy.kvRouting!;
    expect(await until(() => routing.follower.names.length === 2)).toBe(true);
    expect(routing.follower.names.sort()).toEqual(['pa', 'pb']);
    const first = await complete(proxy, `${PREFIX}What is 2 + 2?`);
    const holder = first.nixl_node.prefill;
    expect(['pa', 'pb']).toContain(holder);
    expect(await until(() => routing.index.workers.includes(holder) && routing.index.size > 0)).toBe(true);
    expect((await complete(proxy, `${PREFIX}Name a colour.`)).nixl_node.prefill).toBe(holder);
    const [leaving, staying] = holder === 'pa' ? [a, 'pb'] : [b, 'pa'];
    await closeOnce(leaving);
    expect(await until(() => !routing.follower.names.includes(holder))).toBe(true);
    expect(routing.follower.names).toEqual([staying]);
    expect(routing.index.workers).not.toContain(holder);
    expect(routing.index.size).toBe(0); // the other one was sent nothing
  });
});
