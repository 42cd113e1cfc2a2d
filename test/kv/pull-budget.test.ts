// A pull's wait for its handshake: an abort ends it at once, and a pull given
// a handshake budget (bidirectional KV's read of a previous turn, only an
// optimisation) gives up within it; a pull without one keeps the puller's
// retries. Found by attack: a turn-2 prefill whose previous decode had died
// waited 3 x 5 s of handshake attempts before recomputing, aborted or not.
import { type Socket, createServer } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, KvPuller, NixlAgent, type PullError } from '../../lib';
import * as kv from '../../demo/kvpattern';

const spec = { heads: 8, headBytes: 1024, numBlocks: 16, regions: 2, method: 'zmq' as const, tpSize: 1 };
const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

/** A port that accepts connections and never answers (kept open, so no other process can take it). */
async function deadPort(): Promise<number> {
  const held: Socket[] = [];
  const s = createServer((c) => held.push(c));
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  closers.push(() => {
    for (const c of held) c.destroy();
    return new Promise((r) => s.close(r));
  });
  return (s.address() as { port: number }).port;
}

function puller(name: string): KvPuller {
  const agent = new NixlAgent(name, { engine: 'loopback' });
  const mem = Buffer.alloc(kv.rankBytes({ ...spec, tpRank: 0 }));
  agent.registerMemory(mem);
  const p = new KvPuller({
    agent,
    layout: kv.rankLayout({ ...spec, tpRank: 0 }, 'decode', DescList.from(mem).addr(0)),
    handshake: 'zmq',
    handshakeTimeoutMs: 400,
  });
  closers.push(
    () => agent.close(),
    () => p.close(),
  );
  return p;
}

async function failure(pull: Promise<unknown>): Promise<{ kind: string; ms: number }> {
  const t0 = performance.now();
  const e = (await pull.then(
    () => undefined,
    (x: unknown) => x,
  )) as PullError | undefined;
  expect(e, 'the pull must fail').toBeDefined();
  return { kind: e!.kind, ms: performance.now() - t0 };
}

describe('a pull waiting for its handshake', () => {
  it('an abort ends it at once (not after the handshake attempts)', async () => {
    const p = puller('budget-abort');
    const remote = { host: '127.0.0.1', port: await deadPort(), tpSize: 1 };
    const ac = new AbortController();
    setTimeout(() => ac.abort(new Error('client gone')), 100);
    const f = await failure(
      p.pullBlocks({ remote, localBlockIds: [0], remoteBlockIds: [0], requestId: 'r-abort', signal: ac.signal }),
    );
    expect(f.kind).toBe('aborted');
    // Three attempts of 400 ms would be >= 1200 ms.
    expect(f.ms).toBeLessThan(700);
    // A second pull joining a connect still under way is aborted alike.
    const ac2 = new AbortController();
    const first = p.pullBlocks({ remote, localBlockIds: [1], remoteBlockIds: [1], requestId: 'r-first' });
    setTimeout(() => ac2.abort(), 100);
    const f2 = await failure(
      p.pullBlocks({ remote, localBlockIds: [2], remoteBlockIds: [2], requestId: 'r-joined', signal: ac2.signal }),
    );
    expect(f2.kind).toBe('aborted');
    expect(f2.ms).toBeLessThan(700);
    expect((await failure(first)).kind).toBe('handshake');
  });

  it("a budget of one short attempt gives up within it; without one the puller's 3 attempts stay", async () => {
    const p = puller('budget-short');
    const remote = { host: '127.0.0.1', port: await deadPort(), tpSize: 1 };
    const budget = { timeoutMs: 100, retries: 0 };
    const short = await failure(
      p.pullBlocks({ remote, localBlockIds: [0], remoteBlockIds: [0], requestId: 'r-short', handshake: budget }),
    );
    expect(short.kind).toBe('handshake');
    expect(short.ms).toBeLessThan(600);
    const normal = await failure(p.pullBlocks({ remote, localBlockIds: [0], remoteBlockIds: [0], requestId: 'r-n' }));
    expect(normal.kind).toBe('handshake');
    expect(normal.ms).toBeGreaterThanOrEqual(3 * 400 - 50);
    // A budgeted pull joining that slow connect waits at most its budget's deadline.
    const slow = p.pullBlocks({ remote, localBlockIds: [0], remoteBlockIds: [0], requestId: 'r-slow' });
    const joined = await failure(
      p.pullBlocks({ remote, localBlockIds: [1], remoteBlockIds: [1], requestId: 'r-joined', handshake: budget }),
    );
    expect(joined.kind).toBe('handshake');
    expect(joined.ms).toBeLessThan(700);
    await failure(slow);
  });
});
