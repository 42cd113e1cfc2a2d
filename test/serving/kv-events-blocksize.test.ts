// A proxy keying prompts by 16-token blocks follows workers whose block size
// is a multiple of 16: a 64-token block is four of the proxy's keys, its
// removal removes those four, and a worker's match is floored to its own
// block size (what it can reuse: a GGUF worker reuses whole batches only),
// so the prompt goes to the prefill holding the longest REUSABLE prefix. A
// block size that is not a multiple is refused and counted. Publishers are
// EventPeers (vLLM's wire format, events of the test's making).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { startProxy, startWorker } from '../../lib/serving';
import { promptKeys } from '../../lib/serving/kv-index/index';
import { modelPath } from '../../lib/serving/models/test-models';
import { ETCD_MISSING, EtcdServer } from '../etcd-server';
import {
  EventPeer,
  chat,
  complete,
  etcdFleet,
  httpWorkers,
  staticPreciseProxy,
  storedText,
  until,
} from './kv-routing-helpers';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-kv-blocksize-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

/** `n` characters of text no other text here shares a first block with. */
const text = (seed: string, n: number) => `${seed}: ${'abcdefghijklmnopqrstuvwxyz0123456789'.repeat(8)}`.slice(0, n);
/** Past the decisions' speculative entries (a 1 ms TTL counts to the next 100 ms tick). */
const expired = () => new Promise((r) => setTimeout(r, 250));
const slots = (...texts: string[]) => new Set(texts.flatMap((t) => promptKeys(Buffer.from(t), 16).map((k) => k | 0)));

describe('per-worker block size: a B=16 proxy, one publisher at 64 and one at 16', () => {
  it('routes to the longest reusable prefix, removes 64-blocks as 4 keys, refuses 24, rebuilds after a gap', async () => {
    const [p64, p16, p24] = await Promise.all([EventPeer.open(), EventPeer.open(), EventPeer.open()]);
    closers.push(
      () => p64.close(),
      () => p16.close(),
      () => p24.close(),
    );
    const [a, b, d] = await httpWorkers(3, closers);
    const PA = text('PA', 140);
    const PB = text('PB', 80);
    // The 64-worker (a) holds PA's first 128 tokens and PB's first 64; the 16-worker (b) PA's 96 and PB's 48.
    await p64.send(storedText(PA.slice(0, 128), 64, [0xa1n, 0xa2n]), storedText(PB.slice(0, 64), 64, [0xb1n]));
    await p16.send(
      storedText(PA.slice(0, 96), 16, [1n, 2n, 3n, 4n, 5n, 6n]),
      storedText(PB.slice(0, 48), 16, [11n, 12n, 13n]),
    );
    await p24.send(storedText(PA.slice(0, 48), 24, [21n, 22n]));
    const stray = 'http://127.0.0.1:9'; // followed by name only: never a candidate
    const proxy = await staticPreciseProxy(
      [a, b],
      [d],
      {
        endpoints: { [a.address]: p64.endpoint, [b.address]: p16.endpoint, [stray]: p24.endpoint },
        blockSize: 16,
        // No speculative entries: only the events say who holds what.
        index: { speculativeTtlMs: 1 },
      },
      closers,
    );
    const routing = proxy.kvRouting!;
    await until(() => routing.index.size === 12 + 9 && (routing.stats['dropped:block_size'] ?? 0) > 0);
    const held = (w: string) =>
      new Set(
        routing.index
          .views()
          .workers.get(w)
          ?.keys.map(([s]) => s),
      );
    expect(held(a.address)).toEqual(slots(PA.slice(0, 128), PB.slice(0, 64)));
    expect(routing.index.knows(stray)).toBe(false);

    // 70 tokens of PB: the 64-worker can reuse 64, the 16-worker 48.
    expect((await complete(proxy, PB.slice(0, 70))).nixl_node).toMatchObject({
      prefill: a.address,
      prefix_match_tokens: 64,
    });
    expect((await complete(proxy, PA)).nixl_node).toMatchObject({ prefill: a.address, prefix_match_tokens: 128 });
    // 112 tokens of PA, then other text: the 64-worker holds 112 of them in 16-token keys but can
    // reuse only its first whole 64-block; the 16-worker reuses 96.
    const q = `${PA.slice(0, 112)}${'y'.repeat(30)}`;
    expect((await complete(proxy, q)).nixl_node).toMatchObject({ prefill: b.address, prefix_match_tokens: 96 });
    await expired();

    // The 64-worker drops its second PA block: its four keys go, nothing else.
    await p64.send({ type: 'BlockRemoved', blockHashes: [0xa2n] });
    await until(() => routing.index.size === 8 + 9);
    expect(held(a.address)).toEqual(slots(PA.slice(0, 64), PB.slice(0, 64)));
    expect((await complete(proxy, PA)).nixl_node).toMatchObject({ prefill: b.address, prefix_match_tokens: 96 });
    await expired();

    // A gap on the 64-worker: the batch it never sent live comes by replay, chained on its parent.
    const before = routing.stats.gaps ?? 0;
    p64.skip = 1;
    await p64.send(storedText(PA.slice(64, 128), 64, [0xa2n], 0xa1n));
    await p64.send(storedText(text('PC', 64), 64, [0xc1n]));
    await until(() => routing.index.size === 16 + 9);
    expect(routing.stats.gaps).toBeGreaterThan(before);
    const want = slots(PA.slice(0, 128), PB.slice(0, 64), text('PC', 64));
    expect(held(a.address)).toEqual(want);
    expect((await complete(proxy, PA)).nixl_node).toMatchObject({ prefill: a.address, prefix_match_tokens: 128 });
    // Followed again from scratch (index dropped, replay from 0): the same keys.
    routing.subscribe(a.address, p64.endpoint);
    await until(() => routing.index.size === 16 + 9);
    expect(held(a.address)).toEqual(want);

    const metrics = await (await fetch(`${proxy.url}/metrics`)).text();
    expect(metrics).toMatch(/nixl_node_proxy_kv_events_dropped_total\{reason="block_size"\} [1-9]/);
  }, 60_000);
});

describe.skipIf(ETCD_MISSING !== '')(`without --kv-block-size, over a fleet in etcd${ETCD_MISSING}`, () => {
  it('a worker at 64 first, one at 16 later: keyed by 16 from then on, the first followed again', async () => {
    const etcd = await new EtcdServer().start();
    closers.push(() => etcd.destroy());
    const { role: fleet, proxy: fleetProxy } = etcdFleet(etcd.url, '/kv-blocksize/');
    const kvEvents = (name: string) => ({
      enable_kv_cache_events: true,
      endpoint: `ipc://${dir}/${name}-pub`,
      replay_endpoint: `ipc://${dir}/${name}-replay`,
    });
    const model = (blockSize: number) => ({ blockSize, layers: 2, blockBytes: 1024 });
    const a = await startWorker({ name: 'p64', model: model(64), kvEvents: kvEvents('p64'), etcd: fleet('prefill') });
    const d = await startWorker({ name: 'dd', model: model(64), etcd: fleet('decode') });
    closers.push(
      () => a.close(),
      () => d.close(),
    );
    const proxy = await fleetProxy();
    closers.push(() => proxy.close());
    const routing = proxy.kvRouting!;
    await until(() => routing.follower.names.length === 1);
    expect(routing.blockSize).toBe(64);
    const P = text('fleet', 200);
    expect((await complete(proxy, P)).nixl_node.prefill).toBe('p64');
    await until(() => routing.index.size === 3); // 192 tokens: three 64-token keys

    const b = await startWorker({ name: 'p16', model: model(16), kvEvents: kvEvents('p16'), etcd: fleet('prefill') });
    closers.push(() => b.close());
    await until(() => routing.follower.names.length === 2 && routing.blockSize === 16);
    // p64's blocks came back by replay, each as four 16-token keys.
    await until(() => routing.index.size === 12);
    expect(routing.stats['refused:block_size']).toBeUndefined();
    await expired();
    // 150 tokens of P: p64 holds 144 of them in 16-token keys and reuses two whole blocks, 128.
    const ans = await complete(proxy, `${P.slice(0, 150)}${'z'.repeat(20)}`);
    expect(ans.nixl_node).toMatchObject({ prefill: 'p64', prefix_match_tokens: 128 });
  }, 60_000);
});

describe('GGUF prefills announcing whole batches of 32 behind a proxy keying by 16', () => {
  it("the proxy's prefix_match_tokens is what the chosen prefill then reuses: whole batches", async () => {
    const BATCH = 32;
    const common = { model: modelPath('tiny'), contextSize: 1024, threads: 1, parallel: 1, batchSize: BATCH };
    const prefills = await Promise.all(
      [0, 1].map((i) =>
        startWorker({
          ...common,
          role: 'prefill',
          kvEvents: { enable_kv_cache_events: true, endpoint: `ipc://${dir}/g${i}` },
        }),
      ),
    );
    const decode = await startWorker({ ...common, role: 'decode' });
    closers.push(...[...prefills, decode].map((w) => () => w.close()));
    const proxy = await startProxy({
      prefill: prefills.map((w) => w.address),
      decode: [decode.address],
      policy: 'precise',
      // Followed from what they advertise (block_size 32) in their /health answers.
      kvEvents: { blockSize: 16, tokenizer: { gguf: modelPath('tiny') }, index: { speculativeTtlMs: 1 } },
    });
    closers.push(() => proxy.close());
    const routing = proxy.kvRouting!;
    await until(() => routing.follower.names.length === 2);
    const system = 'A shared beginning for every question here, long enough for several batches. '.repeat(3);
    const ask = (question: string) => chat(proxy, system, question);
    const first = await ask('One?');
    await until(() => routing.index.size > 0);
    await expired();
    const holder = prefills.find((w) => w.address === first.prefill)!;
    const before = holder.stats.prefixReusedTokens;
    const second = await ask('Two?');
    expect(second.prefill).toBe(first.prefill);
    expect(second.prefix_match_tokens).toBeGreaterThanOrEqual(2 * BATCH);
    expect(second.prefix_match_tokens % BATCH).toBe(0);
    expect(holder.stats.prefixReusedTokens - before).toBe(second.prefix_match_tokens);
    expect(routing.stats['refused:block_size']).toBeUndefined();
  }, 120_000);
});
