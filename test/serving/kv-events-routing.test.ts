// Precise routing on a vLLM-format publisher not written with the project's
// code (test/fixtures/vllm_kv_events_peer.py: Python, zmq + msgpack): the
// proxy replays what the peer published before it connected, follows its
// live batches (map and positional events), and sends each prompt to the
// prefill whose events say it holds the prompt's leading blocks, saying so
// in the answer (nixl_node.prefill, nixl_node.prefix_match_tokens).
import { type ChildProcessWithoutNullStreams, spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { Packr } from 'msgpackr';
import { afterEach, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import { FIXTURES, PY, pythonZmqMissing } from '../helpers';
import { complete, httpWorkers, staticPreciseProxy } from './kv-routing-helpers';

const missing = pythonZmqMissing();
if (missing) console.warn(`KV events routing interop skipped: ${missing}`);

class PyPublisher {
  readonly #p: ChildProcessWithoutNullStreams;
  readonly #lines: AsyncIterator<string>;
  constructor() {
    this.#p = spawn(PY, [path.join(FIXTURES, 'vllm_kv_events_peer.py')]);
    this.#lines = readline.createInterface({ input: this.#p.stdout })[Symbol.asyncIterator]();
  }
  async next(): Promise<Record<string, unknown>> {
    const r = await this.#lines.next();
    if (r.done) throw new Error('the Python publisher exited');
    return JSON.parse(r.value);
  }
  async send(cmd: Record<string, unknown>): Promise<Record<string, unknown>> {
    this.#p.stdin.write(`${JSON.stringify(cmd)}\n`);
    return this.next();
  }
  close(): void {
    this.#p.kill();
  }
}

async function until(what: () => boolean, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((r) => setTimeout(r, 20));
  }
}

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

describe.skipIf(missing !== undefined)('precise routing from a vLLM-format KV-event publisher (Python)', () => {
  it("replays the peer's earlier batches, follows its live ones, and routes each prompt to the prefill holding it", async () => {
    const peer = new PyPublisher();
    closers.push(() => peer.close());
    const ep = (await peer.next()) as { pub: string; replay: string };
    const [a, b, d] = await httpWorkers(3, closers);
    const long = 'The quick brown fox jumps over the lazy dog, again and again, until the story ends.'; // 5 blocks
    // Published before the proxy exists: only a replay on connect can tell it.
    await peer.send({ store: long.slice(0, 64), block_size: 16 });
    const proxy = await staticPreciseProxy([a, b], [d], { endpoints: { [b.address]: ep }, blockSize: 16 }, closers);
    const routing = proxy.kvRouting!;
    await until(() => routing.index.size >= 4);
    expect(routing.stats.replays).toBeGreaterThanOrEqual(1);

    // Four times: whatever the turn, the holder of the 4 leading blocks wins. After the first, the
    // decision's speculative entry (all 5 blocks, until an event confirms) may count too.
    for (let i = 0; i < 4; i++) {
      const ans = await complete(proxy, long);
      expect(ans.nixl_node.prefill).toBe(b.address);
      if (i === 0) expect(ans.nixl_node.prefix_match_tokens).toBe(64);
      else expect([64, 80]).toContain(ans.nixl_node.prefix_match_tokens);
    }
    // A prompt nobody holds: load decides, and says it matched nothing (spread over both).
    const other = new Set<string>();
    for (let i = 0; i < 4; i++) {
      const ans = await complete(proxy, `${i}: nobody has this prompt ${'z'.repeat(40)}`);
      expect(ans.nixl_node.prefix_match_tokens).toBe(0);
      other.add(ans.nixl_node.prefill);
    }
    expect(other.size).toBe(2);

    // A live positional (vLLM <= 0.23) store, then the whole cache cleared.
    const second = 'Another conversation entirely, long enough for three blocks!!';
    await peer.send({ store: second, block_size: 16, form: 'array' });
    await until(() => routing.index.size >= 7);
    expect((await complete(proxy, second)).nixl_node).toEqual(
      expect.objectContaining({ prefill: b.address, prefix_match_tokens: 48 }),
    );
    await peer.send({ clear: true });
    await until(() => routing.index.size === 0);
    // A gap on the live path (seq skipped) is replayed: the index gets the missing store.
    await peer.send({ skip: 1 });
    await peer.send({ store: long.slice(0, 32), block_size: 16 });
    await peer.send({ store: second, block_size: 16 });
    await until(() => routing.index.size >= 5);
    expect(routing.stats.gaps).toBeGreaterThanOrEqual(1);
    expect(routing.stats.replay_lost).toBeUndefined();
    expect(routing.stats['decisions:prefix']).toBeGreaterThanOrEqual(5);

    const metrics = await (await fetch(`${proxy.url}/metrics`)).text();
    expect(metrics).toMatch(/nixl_node_proxy_kv_events_applied_total \d+/);
    expect(metrics).toMatch(/nixl_node_proxy_kv_routing_decisions_total\{reason="prefix"\} \d+/);
    expect(metrics).toMatch(/nixl_node_proxy_kv_index_blocks 5/);
  }, 60_000);
});

describe('hostile KV-event publisher', () => {
  it('a flood of malformed messages and batches is dropped and counted while requests keep being routed', async () => {
    const pub = new zmq.Publisher();
    await pub.bind('tcp://127.0.0.1:*');
    closers.push(() => pub.close());
    const [a, d] = await httpWorkers(2, closers);
    const proxy = await staticPreciseProxy(
      [a],
      [d],
      { endpoints: { [a.address]: { pub: pub.lastEndpoint! } }, blockSize: 16 },
      closers,
    );
    const routing = proxy.kvRouting!;
    const packr = new Packr({ useRecords: false, useBigInt64: true } as never);
    const seq = (n: number) => {
      const b = Buffer.alloc(8);
      b.writeBigUInt64BE(BigInt(n));
      return b;
    };
    const bad = [
      [Buffer.from('t')], // one frame
      [Buffer.from('t'), Buffer.from('1234'), Buffer.from('x')], // a 4-byte seq
      [Buffer.from('t'), seq(0), Buffer.from([0xc1, 0xff])], // not msgpack
      [Buffer.from('t'), seq(1), packr.pack([0, [['Mystery'], ['BlockStored', ['x']], 7]])], // bad events
      [Buffer.from('t'), seq(2), packr.pack([0, new Array(200_000).fill(0)])], // too many events
    ];
    // The subscriber needs a moment to join: keep sending until it has seen some.
    const flood = (async () => {
      for (let round = 0; round < 400 && !(routing.stats['dropped:unknown_type'] ?? 0); round++) {
        for (const m of bad) await pub.send(m);
        await new Promise((r) => setTimeout(r, 5));
      }
      for (let i = 0; i < 2000; i++) await pub.send(bad[i % 4]);
    })();
    const answers = await Promise.all(
      Array.from({ length: 6 }, (_, i) => complete(proxy, `${i} routed while flooded ${'q'.repeat(32)}`)),
    );
    await flood;
    await until(
      () =>
        (routing.stats['dropped:malformed_message'] ?? 0) > 0 && (routing.stats['dropped:malformed_batch'] ?? 0) > 0,
    );
    for (const ans of answers) expect(ans.nixl_node.prefill).toBe(a.address);
    expect(routing.stats['dropped:unknown_type']).toBeGreaterThan(0);
    expect(routing.stats['dropped:wrong_type']).toBeGreaterThan(0);
    expect(routing.index.size).toBe(0);
  }, 60_000);
});
