// The fleet's pieces that need no etcd: reading records strictly, the 'load'
// policy (reported load, free blocks, prefix affinity by rendezvous hashing),
// the proxy routing a shared prefix to one prefill until it is overloaded,
// and the command's checks of its fleet options.
import { spawnSync } from 'node:child_process';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
import { startProxy, startWorker, type WorkerRef } from '../../lib/serving';
import { type WorkerRecord, parseRecord } from '../../lib/serving/fleet/record';
import { affinityKey, affinityOrder, loadOf, pickByLoad } from '../../lib/serving/fleet/routing';

const ROOT = path.join(__dirname, '..', '..');
const BIN = path.join(ROOT, 'bin', 'nixl-node.js');

const rec: WorkerRecord = {
  v: 1,
  name: 'w0',
  role: 'both',
  model: 'synthetic',
  address: 'http://127.0.0.1:8001',
  transport: 'http',
  freeBlocks: 10,
  totalBlocks: 64,
  load: 2,
};

function ref(address: string, outstanding = 0, reported?: WorkerRef['reported']): WorkerRef {
  return { address, stage: 'prefill', healthy: true, outstanding, failures: 0, reported };
}

describe('worker records', () => {
  it('reads a well-formed record, and a trailing slash off its address', () => {
    expect(parseRecord(JSON.stringify(rec))).toEqual(rec);
    expect(parseRecord(JSON.stringify({ ...rec, address: 'http://127.0.0.1:8001/' }))).toEqual(rec);
    const z = { ...rec, transport: 'zmq', address: 'tcp://127.0.0.1:5555' };
    expect(parseRecord(JSON.stringify(z))).toEqual(z);
  });

  it.each([
    ['not json', 'not JSON'],
    ['[]', 'not a JSON object'],
    [JSON.stringify({ ...rec, v: 2 }), 'version'],
    [JSON.stringify({ ...rec, name: 'a b' }), "'name'"],
    [JSON.stringify({ ...rec, role: 'admin' }), "'role'"],
    [JSON.stringify({ ...rec, model: 7 }), "'model'"],
    [JSON.stringify({ ...rec, transport: 'udp' }), "'transport'"],
    [JSON.stringify({ ...rec, address: 'ftp://127.0.0.1:1' }), "'address'"],
    [JSON.stringify({ ...rec, address: 'http://127.0.0.1:1/v1' }), "'address'"],
    [JSON.stringify({ ...rec, transport: 'zmq' }), "'address'"],
    [JSON.stringify({ ...rec, load: 1.5 }), "'load'"],
    [JSON.stringify({ ...rec, freeBlocks: -1 }), "'freeBlocks'"],
    [JSON.stringify({ ...rec, totalBlocks: 2 ** 40 }), "'totalBlocks'"],
    [JSON.stringify({ ...rec, freeBlocks: 65 }), 'more than'],
    [JSON.stringify({ ...rec, pad: 'x'.repeat(5000) }), 'bytes'],
  ])('refuses a bad value (%#)', (value, why) => {
    const r = parseRecord(value);
    expect(typeof r).toBe('string');
    expect(r).toContain(why);
  });
});

describe("the 'load' policy", () => {
  const ws = ['a', 'b', 'c', 'd'].map((x) => ref(`http://127.0.0.1:90${x.charCodeAt(0) - 90}`));

  it('without a key: the least loaded (own count or reported), ties in turn', () => {
    const w = [
      ref('http://h:1', 3),
      ref('http://h:2', 0, { load: 5, freeBlocks: 9, totalBlocks: 10 }),
      ref('http://h:3', 1),
    ];
    expect(pickByLoad(w, 0, undefined)?.address).toBe('http://h:3');
    const tied = [ref('http://h:1'), ref('http://h:2')];
    expect([0, 1, 2, 3].map((t) => pickByLoad(tied, t, undefined)?.address)).toEqual([
      'http://h:1',
      'http://h:2',
      'http://h:1',
      'http://h:2',
    ]);
    // A worker almost out of KV blocks counts as loaded.
    expect(loadOf(ref('http://h:9', 0, { load: 0, freeBlocks: 1, totalBlocks: 100 }))).toBeGreaterThan(100);
    expect(
      pickByLoad(
        [ref('http://h:9', 0, { load: 0, freeBlocks: 1, totalBlocks: 100 }), ref('http://h:8', 3)],
        0,
        undefined,
      )?.address,
    ).toBe('http://h:8');
  });

  it('a key keeps its worker; keys spread; a worker leaving moves only the keys it held', () => {
    const keys = Array.from({ length: 400 }, (_, i) => `prefix ${i}`);
    const owner = new Map(keys.map((k) => [k, pickByLoad(ws, 0, k)!.address]));
    for (const k of keys) expect(pickByLoad(ws, 7, k)!.address).toBe(owner.get(k));
    const counts = new Map<string, number>();
    for (const a of owner.values()) counts.set(a, (counts.get(a) ?? 0) + 1);
    for (const w of ws) expect(counts.get(w.address)).toBeGreaterThan(60);
    const without = ws.slice(1);
    for (const k of keys) {
      const now = pickByLoad(without, 0, k)!.address;
      if (owner.get(k) !== ws[0].address) expect(now).toBe(owner.get(k));
      else expect(now).toBe(affinityOrder(k, ws)[1].address);
    }
  });

  it('an overloaded first choice passes the key to the next in its order', () => {
    const order = affinityOrder('k', ws);
    order[0].outstanding = 5; // more than slack (4) over the least loaded
    expect(pickByLoad(ws, 0, 'k')).toBe(order[1]);
    order[0].outstanding = 4;
    expect(pickByLoad(ws, 0, 'k')).toBe(order[0]);
    expect(pickByLoad(ws, 0, 'k', { slack: 1 })).toBe(order[1]);
    order[0].outstanding = 0;
  });

  it('affinity keys: the start of long prompts, nothing for short ones', () => {
    const long = 'You are a helpful assistant. '.repeat(40);
    expect(affinityKey({ prompt: 'short' })).toBeUndefined();
    expect(affinityKey({ prompt: `${long} question one` })).toBe(affinityKey({ prompt: `${long} question two` }));
    expect(affinityKey({ prompt: `A${long}` })).not.toBe(affinityKey({ prompt: long }));
    const chat = (q: string) => ({
      messages: [
        { role: 'system', content: long },
        { role: 'user', content: q },
      ],
    });
    expect(affinityKey(chat('a'))).toBe(affinityKey(chat('b')));
    expect(affinityKey({ prompt: Array.from({ length: 300 }, (_, i) => i) })).toBeDefined();
    expect(affinityKey({ prompt: long }, { prefixChars: 0 })).toBeUndefined();
    expect(affinityKey({ prompt: long, model: 'm1' })).not.toBe(affinityKey({ prompt: long, model: 'm2' }));
  });
});

describe('the proxy routes a shared prefix to one prefill while it keeps up', () => {
  it('same prefix: one prefill; many prefixes: all of them; overloaded: another one', async () => {
    const prefills = await Promise.all([0, 1, 2].map(() => startWorker({ blocks: 1024 })));
    const decode = await startWorker({ blocks: 2048 });
    const proxy = await startProxy({
      prefill: prefills.map((w) => w.address),
      decode: [decode.address],
      policy: 'load',
      healthIntervalMs: 0,
    });
    const long = 'The same long system prompt for every request. '.repeat(12);
    const ask = async (prompt: string) => {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ prompt, max_tokens: 2 }),
      });
      const text = await r.text();
      expect(r.status, text).toBe(200);
    };
    const counts = () => prefills.map((w) => w.stats.prefills);
    try {
      // One at a time: all on the prefix's prefill.
      for (let i = 0; i < 9; i++) await ask(`${long} question ${i}`);
      expect(counts().sort()).toEqual([0, 0, 9]);
      const owner = counts().indexOf(9);
      // Distinct prefixes spread over all three.
      for (let i = 0; i < 30; i++) await ask(`${i} ${long}`);
      expect(counts().every((n) => n > 0)).toBe(true);
      // The prefix's prefill overloaded (other requests outstanding on it): the prefix goes elsewhere while it is.
      const ref = proxy.pools.prefill.workers.find((w) => w.address === prefills[owner].address)!;
      ref.outstanding += 10;
      let before = counts();
      for (let i = 0; i < 4; i++) await ask(`${long} while busy ${i}`);
      expect(counts()[owner]).toBe(before[owner]);
      ref.outstanding -= 10;
      before = counts();
      await ask(`${long} after`);
      expect(counts()[owner]).toBe(before[owner] + 1);
      // 16 at once on one prefix: all answered, on whichever prefill kept up.
      before = counts();
      await Promise.all(Array.from({ length: 16 }, (_, i) => ask(`${long} burst ${i}`)));
      expect(counts().reduce((a, b) => a + b) - before.reduce((a, b) => a + b)).toBe(16);
    } finally {
      await proxy.close();
      await Promise.all([...prefills, decode].map((w) => w.close()));
    }
  });
});

describe('the command', () => {
  const cli = (args: string[], env: NodeJS.ProcessEnv = {}) =>
    spawnSync(process.execPath, [BIN, ...args], { encoding: 'utf8', env: { ...process.env, ...env }, timeout: 20_000 });

  it('refuses fleet options that do not fit, with exit code 2', () => {
    for (const args of [
      ['worker', '--role', 'prefill'],
      ['worker', '--etcd', 'http://127.0.0.1:1', '--role', 'boss'],
      ['worker', '--etcd', 'not a url'],
      ['proxy', '--etcd-prefix', '/x/', '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'],
      ['proxy', '--port', '0'],
      ['proxy', '--etcd', 'ftp://127.0.0.1:1'],
    ]) {
      const r = cli(args);
      expect(r.status, args.join(' ')).toBe(2);
      expect(r.stderr.split('\n').filter((l) => l.startsWith('nixl-node ')).length, args.join(' ')).toBe(1);
    }
  });

  it('without the etcd3 package: one line naming it', () => {
    const hide = path.join(__dirname, '..', 'fixtures', 'hide-etcd3.js');
    const r = cli(['worker', '--etcd', 'http://127.0.0.1:1'], { NODE_OPTIONS: `--require ${hide}` });
    expect(r.status).not.toBe(0);
    const lines = r.stderr.split('\n').filter((l) => l.includes('etcd'));
    expect(lines).toEqual([expect.stringContaining('npm i -E etcd3@1.1.2')]);
  });
});
