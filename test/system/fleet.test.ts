// Fleets through a real etcd: workers register under leases, the proxy
// follows them. Joins and leaves under load lose nothing a healthy worker
// could serve; etcd restarted or gone leaves the proxy serving what it knew;
// 20 workers churning end with the proxy's pools equal to the live set; no
// value anyone writes under the fleet's prefix brings the proxy down.
import { type ChildProcess, spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type * as Etcd3 from 'etcd3';
import { type ServingProxy, type Worker, startProxy, startWorker } from '../../lib/serving';
import { etcdClient } from '../../lib/serving/fleet/etcd-client';
import { ETCD_MISSING, EtcdServer } from '../etcd-server';
import { repeatedJsonKeys } from '../helpers';

const TTL = 2;
const BIN = path.join(__dirname, '..', '..', 'bin', 'nixl-node.js');

/** The command, up to its ready line. */
async function command(
  args: string[],
  env: Record<string, string> = {},
): Promise<{ p: ChildProcess; ready: Record<string, unknown>; stderr: string[] }> {
  const p = spawn(process.execPath, [BIN, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  const stderr: string[] = [];
  readline.createInterface({ input: p.stderr! }).on('line', (l) => stderr.push(l));
  // Bounded, naming the command: a test's own timeout would not say which step hung.
  let timer: NodeJS.Timeout | undefined;
  const ready = await new Promise<Record<string, unknown>>((resolve, reject) => {
    readline.createInterface({ input: p.stdout! }).on('line', (l) => {
      if (l.startsWith('{"ready"')) resolve(JSON.parse(l));
    });
    p.once('exit', (c) => reject(new Error(`${args[0]} exited ${c}: ${stderr.join('\n')}`)));
    timer = setTimeout(() => {
      p.kill('SIGKILL');
      reject(new Error(`${args[0]}: no ready line within 30 s: ${stderr.slice(-5).join('\n')}`));
    }, 30_000);
  }).finally(() => clearTimeout(timer));
  return { p, ready, stderr };
}

/** SIGTERM, then its exit; one that has not exited 20 s later is killed and the test told which. */
async function stop(p: ChildProcess): Promise<number | null> {
  if (p.exitCode !== null) return p.exitCode;
  let timer: NodeJS.Timeout | undefined;
  const exited = new Promise<number | null>((resolve, reject) => {
    p.once('exit', (c) => resolve(c));
    timer = setTimeout(() => {
      p.kill('SIGKILL');
      reject(new Error(`${p.spawnargs.slice(2, 3).join(' ')} (pid ${p.pid}) did not exit within 20 s of SIGTERM`));
    }, 20_000);
  }).finally(() => clearTimeout(timer));
  p.kill('SIGTERM');
  return exited;
}

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

  it("a worker's aliases come with its record: a request for any of them is routed, before any health check", async () => {
    const p = '/aliases/';
    const names = ['acme/llm-7b', 'acme-llm'];
    const w = await startWorker({
      blocks: 64,
      servedModelNames: names,
      etcd: { endpoints: [etcd.url], prefix: p, role: 'both', ttlSec: TTL, drainMs: 3000, log },
    });
    // No health round: what the proxy knows of the worker's names is its record's.
    const proxy = await proxyFor(p, { healthIntervalMs: 0 });
    expect(proxy.pools.decode.workers[0]).toMatchObject({ model: names[0], models: names });
    const r = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: 'acme-llm', prompt: 'by its other name', max_tokens: 2 }),
    });
    expect(r.status).toBe(200);
    expect(((await r.json()) as { model: string }).model).toBe('acme-llm');
    await proxy.close();
    await w.close();
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

  it('etcd restarted: the proxy serves the last known set, says so, and follows again once it is back', async () => {
    const p = '/restart/';
    const ws = await Promise.all([join(p, 'prefill'), join(p, 'decode')]);
    const proxy = await proxyFor(p);
    const l = load(proxy.url, 2);
    await until('answers', () => l.ok > 5);
    logs.length = 0;
    await etcd.stop();
    await until('the proxy to notice', () => !proxy.fleet!.connected, 3000);
    expect(logs.some((x) => /etcd unreachable.*serving the last known 2 fleet worker/.test(x))).toBe(true);
    const metrics = await (await fetch(`${proxy.url}/metrics`)).text();
    expect(metrics).toMatch(/^nixl_node_proxy_etcd_connected 0$/m);
    let before = l.ok;
    await until('answers with etcd down', () => l.ok > before + 10);
    expect(addresses(proxy, 'prefill')).toEqual([ws[0].address]);
    await etcd.start();
    await until('the proxy to follow again', () => proxy.fleet!.connected, 5000);
    expect(logs.some((x) => /etcd reachable: following 2 fleet worker/.test(x))).toBe(true);
    // A worker that joins now is found; the two from before are still listed.
    const late = await join(p, 'both');
    await until('the late worker to serve', () => served(late) > 0, 3000);
    expect(addresses(proxy, 'decode')).toEqual([ws[1].address, late.address].sort());
    before = l.ok;
    await until('more answers', () => l.ok > before + 5);
    expect((await l.stop()).failures).toEqual([]);
    await proxy.close();
    await Promise.all([...ws, late].map((w) => w.close()));
  });

  it('etcd gone for good: workers and proxy keep serving, and shut down without it', async () => {
    const gone = new EtcdServer();
    await gone.start();
    const opts = { endpoints: [gone.url], prefix: '/gone/', ttlSec: TTL, drainMs: 1000, log };
    const ws = await Promise.all([
      startWorker({ blocks: 64, etcd: { ...opts, role: 'prefill' } }),
      startWorker({ blocks: 64, etcd: { ...opts, role: 'decode' } }),
    ]);
    const proxy = await startProxy({ etcd: { ...opts, resyncMs: 500 }, healthIntervalMs: 300 });
    await gone.destroy();
    await until('the proxy to notice', () => !proxy.fleet!.connected, 3000);
    // Longer than the leases: nothing in the proxy depends on them.
    await new Promise((r) => setTimeout(r, (TTL + 1) * 1000));
    const l = load(proxy.url, 2);
    await until('answers', () => l.ok > 10);
    expect((await l.stop()).failures).toEqual([]);
    expect(addresses(proxy, 'prefill')).toEqual([ws[0].address]);
    const t0 = Date.now();
    await Promise.all([proxy.close(), ...ws.map((w) => w.close())]);
    expect(Date.now() - t0).toBeLessThan(6000);
  });

  it('20 workers churning under load: the pools end equal to the live set, nothing lost', async () => {
    const p = '/churn/';
    const live = new Set<Worker>(await Promise.all(Array.from({ length: 6 }, (_, i) => join(p, 'both', `churn-${i}`))));
    const proxy = await proxyFor(p, { policy: 'load' });
    await until('the first six', () => proxy.pools.prefill.size === 6);
    const l = load(proxy.url, 4);
    let started = 6;
    const leaving: Promise<void>[] = [];
    while (started < 20) {
      // One joins, and now and then one leaves (it drains what it has).
      live.add(await join(p, 'both', `churn-${started++}`));
      if (started % 2 === 0) {
        const w = [...live][Math.floor(Math.random() * live.size)];
        live.delete(w);
        leaving.push(w.close());
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    await Promise.all(leaving);
    const want = [...live].map((w) => w.address).sort();
    await until('the pools to equal the live set', () => addresses(proxy, 'prefill').join() === want.join(), 3000);
    expect(addresses(proxy, 'decode')).toEqual(want);
    const r = await l.stop();
    expect(r.failures).toEqual([]);
    expect(r.ok).toBeGreaterThan(20);
    await proxy.close();
    await Promise.all([...live].map((w) => w.close()));
  });

  it('hostile values under the prefix (garbage, huge, wrong types) are ignored; the proxy serves on', async () => {
    const p = '/hostile/';
    const good = await join(p, 'both');
    const proxy = await proxyFor(p);
    const c: Etcd3.Etcd3 = etcdClient({ endpoints: [etcd.url] });
    const rec = good.fleet!.record();
    const bad: Array<[string, string | Buffer]> = [
      ['garbage', 'not json {'],
      ['binary', Buffer.from([0xff, 0xfe, 0x00, 0x80, 0x7b])],
      ['huge', JSON.stringify({ ...rec, name: 'x'.repeat(1_000_000) })],
      ['array', '[1,2,3]'],
      ['null', 'null'],
      ['number', '42'],
      ['no-version', JSON.stringify({ ...rec, v: undefined })],
      ['role', JSON.stringify({ ...rec, role: 'admin' })],
      ['role-type', JSON.stringify({ ...rec, role: ['prefill'] })],
      ['address-scheme', JSON.stringify({ ...rec, address: 'file:///etc/passwd' })],
      ['address-path', JSON.stringify({ ...rec, address: 'http://127.0.0.1:1/v1/evil' })],
      ['address-type', JSON.stringify({ ...rec, address: { toString: 1 } })],
      ['address-zmq', JSON.stringify({ ...rec, transport: 'zmq', address: 'http://127.0.0.1:9' })],
      ['load-negative', JSON.stringify({ ...rec, load: -1 })],
      ['load-nan', JSON.stringify({ ...rec, load: 'NaN' })],
      ['blocks-huge', JSON.stringify({ ...rec, freeBlocks: 1e300, totalBlocks: 1e301 })],
      ['blocks-more-free', JSON.stringify({ ...rec, freeBlocks: 10, totalBlocks: 1 })],
      ['model-control', JSON.stringify({ ...rec, model: 'a\nb' })],
      ['proto', '{"__proto__": {"healthy": false}, "v": 1}'],
      ['deep', `${'['.repeat(5000)}${']'.repeat(5000)}`],
      [Buffer.from([0xc3, 0x28]).toString('latin1'), JSON.stringify(rec).slice(0, 20)],
    ];
    logs.length = 0;
    for (const [k, v] of bad) await c.put(`${p}workers/${k}`).value(v);
    // Keys outside workers/ are not ours to read.
    await c.put(`${p}other`).value('anything');
    const ignoredBefore = proxy.fleet!.stats.ignored;
    await proxy.fleet!.resync();
    expect(proxy.fleet!.stats.ignored).toBeGreaterThanOrEqual(ignoredBefore + bad.length);
    expect(addresses(proxy, 'prefill')).toEqual([good.address]);
    expect(addresses(proxy, 'decode')).toEqual([good.address]);
    expect(logs.some((x) => x.includes('ignoring etcd key') && x.includes('role'))).toBe(true);
    expect(logs.every((x) => x.length < 1000)).toBe(true);
    // A key that stops being garbage joins; one that turns to garbage leaves.
    const other = await startWorker({ blocks: 64 });
    await c.put(`${p}workers/garbage`).value(JSON.stringify({ ...rec, name: 'fixed', address: other.address }));
    await until('the fixed key to join', () => proxy.pools.prefill.size === 2, 2000);
    await c.put(`${p}workers/garbage`).value('broken again');
    await until('the broken key to leave', () => proxy.pools.prefill.size === 1, 2000);
    const l = load(proxy.url, 2);
    await until('answers', () => l.ok > 5);
    expect((await l.stop()).failures).toEqual([]);
    c.close();
    await proxy.close();
    await Promise.all([good.close(), other.close()]);
  });

  it('the commands with etcd stopped: every stderr line is JSON with no key twice, the etcd client included', async () => {
    const down = await new EtcdServer().start();
    const p = '/json-logs/';
    // gRPC's own diagnostics (console.error in @grpc/grpc-js) turned up: they must come out as JSON too.
    const grpc = { GRPC_VERBOSITY: 'DEBUG', GRPC_TRACE: 'subchannel' };
    const worker = await command(
      ['worker', '--etcd', down.url, '--etcd-prefix', p, '--etcd-ttl', '2', '--name', 'w-0'],
      grpc,
    );
    const proxy = await command(['proxy', '--etcd', down.url, '--etcd-prefix', p, '--port', '0', '--health-ms', '200']);
    try {
      expect(worker.ready.etcd_registered).toBe(true);
      await down.stop();
      await until(
        'the proxy to say etcd is unreachable',
        () => proxy.stderr.some((l) => l.includes('etcd unreachable')),
        15_000,
      );
      await until(
        'the worker to lose its lease',
        () => worker.stderr.some((l) => l.includes('etcd lease lost')),
        15_000,
      );
      // Attempts to register again, each a warning.
      await until(
        'two failed attempts',
        () => worker.stderr.filter((l) => l.includes('registration failed')).length >= 2,
        15_000,
      );
    } finally {
      await stop(worker.p);
      await stop(proxy.p);
      await down.destroy();
    }
    for (const [who, lines] of [
      ['worker', worker.stderr],
      ['proxy', proxy.stderr],
    ] as const)
      for (const line of lines) {
        expect(() => JSON.parse(line), `${who}: ${line}`).not.toThrow();
        expect(repeatedJsonKeys(line), `${who}: ${line}`).toEqual([]);
        expect(JSON.parse(line).name, line).toBe(`nixl-node-${who}`);
      }
    expect(worker.stderr.some((l) => JSON.parse(l).source === 'stderr' && l.includes('subchannel'))).toBe(true);
    const lost = JSON.parse(worker.stderr.find((l) => l.includes('etcd lease lost'))!);
    expect(lost).toMatchObject({ level: 40, worker: 'w-0', etcd_key: `${p}workers/w-0` });
  }, 60_000);

  it('a worker started before etcd: unregistered in its ready line and /health, a warning per attempt, registered once etcd answers', async () => {
    const late = await new EtcdServer().start();
    await late.stop(); // its address is known, nothing answers there yet
    const p = '/late/';
    const worker = await command([
      'worker',
      '--etcd',
      late.url,
      '--etcd-prefix',
      p,
      '--etcd-ttl',
      '3',
      '--name',
      'w-late',
    ]);
    const c: Etcd3.Etcd3 = etcdClient({ endpoints: [late.url] });
    try {
      expect(worker.ready).toMatchObject({ etcd: `${p}workers/w-late`, etcd_registered: false });
      const health = async () => (await fetch(`${worker.ready.address}/health`)).json();
      expect(await health()).toMatchObject({ status: 'ok', etcd: `${p}workers/w-late`, etcd_registered: false });
      const failed = () => worker.stderr.filter((l) => l.includes('etcd registration failed'));
      await until('two failed attempts', () => failed().length >= 2, 10_000);
      expect(JSON.parse(failed()[1])).toMatchObject({ level: 40, attempt: 2, etcd_key: `${p}workers/w-late` });
      await late.start();
      // Retries back off to 5 s at most.
      await until('the worker to register', async () => (await health()).etcd_registered === true, 15_000);
      expect((await c.get(`${p}workers/w-late`).string()) ?? '').toContain(String(worker.ready.address));
      expect(worker.stderr.some((l) => l.includes('registered in etcd'))).toBe(true);
    } finally {
      c.close();
      await stop(worker.p);
      await late.destroy();
    }
  }, 60_000);

  it('the command: nixl-node worker --etcd registers, nixl-node proxy --etcd finds it, SIGTERM deregisters', async () => {
    const p = '/command/';
    const worker = await command([
      'worker',
      '--etcd',
      etcd.url,
      '--etcd-prefix',
      p,
      '--role',
      'both',
      '--etcd-ttl',
      '3',
    ]);
    expect(worker.ready.etcd).toBe(`${p}workers/${worker.ready.name}`);
    const proxy = await command(['proxy', '--etcd', etcd.url, '--etcd-prefix', p, '--port', '0']);
    expect(proxy.ready.etcd).toBe(true);
    try {
      const r = await fetch(`${proxy.ready.url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ prompt: 'from the command', max_tokens: 2 }),
      });
      expect(r.status).toBe(200);
      const health = async () => (await (await fetch(`${proxy.ready.url}/health`)).json()).workers.prefill.length;
      expect(await health()).toBe(1);
      expect(await stop(worker.p)).toBe(0);
      // Revoked on the way out: gone at once, not after the lease's 3 s.
      await until('the worker to leave', async () => (await health()) === 0, 1500);
    } finally {
      await stop(worker.p);
      await stop(proxy.p);
    }
  });
});
