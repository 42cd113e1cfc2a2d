// A GGUF model's contexts (lib/serving/models/llama/contexts.ts): a context a
// request may have left unusable is thrown away, never handed out again, and
// replaced for whoever waits; while none can be made the pool says why, and a
// worker's /health and ZeroMQ HEALTH answer that it cannot serve.
import type * as Nlc from 'node-llama-cpp';
import { describe, expect, it } from 'vitest';
import { startProxy } from '../../lib/serving';
import { ContextPool } from '../../lib/serving/models/llama/contexts';
import { SyntheticModel } from '../../lib/serving/models/synthetic';
import { Worker } from '../../lib/serving/worker/worker';

/** A stand-in for a node-llama-cpp context: counts clears and disposals. */
function fakeContext(id: number, o: { clearFails?: boolean } = {}) {
  const c = {
    id,
    cleared: 0,
    disposed: false,
    getSequence: () => ({
      clearHistory: async () => {
        if (o.clearFails) throw new Error('clear failed');
        c.cleared++;
      },
    }),
    dispose: async () => {
      c.disposed = true;
    },
  };
  return c;
}
type Fake = ReturnType<typeof fakeContext>;
const asCtx = (c: Fake) => c as unknown as Nlc.LlamaContext;
const never = new AbortController().signal;

describe('ContextPool', () => {
  it('a discarded context is disposed, never handed out again, and replaced for a waiter', async () => {
    let n = 0;
    const made: Fake[] = [];
    const pool = new ContextPool(1, async () => asCtx(made[made.push(fakeContext(++n)) - 1]));
    const a = (await pool.acquire(never)) as unknown as Fake;
    const waiting = pool.acquire(never);
    await pool.discard(asCtx(a));
    const b = (await waiting) as unknown as Fake;
    expect(a.disposed).toBe(true);
    expect(b.id).toBe(2);
    await pool.release(asCtx(b));
    expect(b.cleared).toBe(1);
    expect(((await pool.acquire(never)) as unknown as Fake).id).toBe(2);
    expect(pool.discarded).toBe(1);
    expect(pool.all.map((c) => (c as unknown as Fake).id)).toEqual([2]);
  });

  it('a context whose clear fails is thrown away, not reused', async () => {
    let n = 0;
    const pool = new ContextPool(1, async () => asCtx(fakeContext(++n, { clearFails: n === 1 })));
    const a = (await pool.acquire(never)) as unknown as Fake;
    await pool.release(asCtx(a));
    expect(a.disposed).toBe(true);
    expect(((await pool.acquire(never)) as unknown as Fake).id).toBe(2);
  });

  it('while no context can be made the pool says why; waiters get the error; a later success clears it', async () => {
    let fail = false;
    let n = 0;
    const pool = new ContextPool(1, async () => {
      if (fail) throw new Error('out of memory');
      return asCtx(fakeContext(++n));
    });
    const a = await pool.acquire(never);
    expect(pool.broken).toBeUndefined();
    fail = true;
    const waiting = pool.acquire(never);
    await pool.discard(a);
    await expect(waiting).rejects.toThrow('out of memory');
    expect(pool.broken).toMatch(/cannot create a llama.cpp context: out of memory/);
    await expect(pool.acquire(never)).rejects.toThrow('out of memory');
    fail = false;
    await pool.acquire(never);
    expect(pool.broken).toBeUndefined();
  });
});

describe('ContextPool: which context a prompt gets', () => {
  /** A context whose sequence holds `tokens`, batches of 2. */
  function cached(id: number) {
    const seq = { contextTokens: [] as number[], clearHistory: async () => void seq.contextTokens.splice(0) };
    return { id, batchSize: 2, getSequence: () => seq, dispose: async () => {}, seq };
  }
  type C = ReturnType<typeof cached>;
  const as = (c: C) => c as unknown as Nlc.LlamaContext;
  const t = (...a: number[]) => a as Nlc.Token[];

  it('the free context sharing the most whole batches; else one caching nothing; else a new one; else the one free longest', async () => {
    let n = 0;
    const pool = new ContextPool(3, async () => as(cached(++n)));
    const [a, b] = [(await pool.acquire(never)) as unknown as C, (await pool.acquire(never)) as unknown as C];
    a.seq.contextTokens.push(1, 2, 3, 4, 5, 6);
    b.seq.contextTokens.push(1, 2, 9, 9);
    await pool.release(as(a), 6);
    await pool.release(as(b), 4);
    // Shares 5 tokens with a (4 in whole batches), 2 with b.
    expect(((await pool.acquire(never, t(1, 2, 3, 4, 5, 7))) as unknown as C).id).toBe(1);
    await pool.release(as(a), 6);
    // Shares 3 with b: 2 in whole batches, more than a's.
    expect(((await pool.acquire(never, t(1, 2, 9, 7))) as unknown as C).id).toBe(2);
    await pool.release(as(b), 4);
    // Shares nothing: a new context rather than evicting a cache.
    const c = (await pool.acquire(never, t(7, 7, 7))) as unknown as C;
    expect(c.id).toBe(3);
    await pool.release(as(c), 0); // cleared: it caches nothing
    expect(((await pool.acquire(never, t(8, 8))) as unknown as C).id).toBe(3);
    // None free caches nothing and none can be made: the one free the longest (a, freed before b).
    expect(((await pool.acquire(never, t(8, 8))) as unknown as C).id).toBe(1);
    // Given back with nothing a prompt may reuse, a context is cleared.
    await pool.release(as(a), 0);
    expect(a.seq.contextTokens).toEqual([]);
  });
});

class SickModel extends SyntheticModel {
  sick: string | undefined = 'cannot create a llama.cpp context: out of memory';
  unhealthy(): string | undefined {
    return this.sick;
  }
}

it.each(['http', 'zmq'] as const)(
  'a worker whose model cannot serve answers /health 503 (HEALTH not ok over ZeroMQ); the proxy sees it (%s)',
  async (transport) => {
    const model = new SickModel();
    const w = await new Worker({ transport }, model).start();
    const proxy = await startProxy({ transport, prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });
    try {
      if (transport === 'http') {
        const h = await fetch(`${w.address}/health`);
        expect(h.status).toBe(503);
        expect(((await h.json()) as { reason: string }).reason).toMatch(/out of memory/);
      }
      await proxy.checkHealth();
      expect((await fetch(`${proxy.url}/v1/models`).then((r) => r.json())) as unknown).toMatchObject({ data: [] });
      model.sick = undefined;
      await proxy.checkHealth();
      if (transport === 'http') expect((await fetch(`${w.address}/health`)).status).toBe(200);
      expect((await fetch(`${proxy.url}/v1/models`).then((r) => r.json())) as unknown).toMatchObject({
        data: [{ id: model.id }],
      });
    } finally {
      await proxy.close();
      await w.close();
    }
  },
  30_000,
);
