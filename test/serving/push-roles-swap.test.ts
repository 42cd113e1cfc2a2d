// Two push workers that serve both stages: one receives a request's KV from
// the other, then pushes the next request's KV back to it. Each worker's
// roles (receiver, sender, puller) share one KvPeers, so the peer's agent is
// loaded once and the second role finds it, where separate caches each tried
// to load it and the second failed ("already loaded").
import { afterEach, expect, it } from 'vitest';
import { startProxy, startWorker } from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

it('push workers swapping prefill and decode with each other answer every request', async () => {
  const a = await startWorker({ name: 'swap-A', transport: 'http', blocks: 128, kvMode: 'push' });
  cleanup.push(() => a.close());
  const b = await startWorker({ name: 'swap-B', transport: 'http', blocks: 128, kvMode: 'push' });
  cleanup.push(() => b.close());
  const proxyFor = async (prefill: string, decode: string) => {
    const p = await startProxy({
      transport: 'http',
      prefill: [prefill],
      decode: [decode],
      healthIntervalMs: 0,
      kvMode: 'push',
      timeoutMs: { prefill: 10_000, decode: 10_000 },
    });
    cleanup.push(() => p.close());
    return p;
  };
  const ab = await proxyFor(a.address, b.address);
  const ba = await proxyFor(b.address, a.address);
  const ask = async (url: string, prompt: string) => {
    const r = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: MODEL_NAME, prompt, max_tokens: 5, temperature: 0 }),
    });
    return { status: r.status, json: (await r.json()) as Record<string, unknown> };
  };
  for (let i = 0; i < 3; i++) {
    const one = await ask(ab.url, `A prefills, B decodes ${i}`);
    expect(one.status, JSON.stringify(one.json)).toBe(200);
    const two = await ask(ba.url, `B prefills, A decodes ${i}`);
    expect(two.status, JSON.stringify(two.json)).toBe(200);
  }
  expect(a.stats.decodes).toBe(3);
  expect(b.stats.decodes).toBe(3);
});
