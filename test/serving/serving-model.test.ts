// Random batches against the proxy (fast-check): valid requests of every
// kind, malformed ones, and clients that give up at random moments, all at
// once. Every valid request that was not abandoned gets the synthetic
// model's answer for its prompt, every malformed one a 4xx, and afterwards
// every worker has all its KV blocks back (reads, or the lease for what an
// abandoned request left behind) and the proxy has nothing in flight.
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type ServingProxy, type Worker, startProxy, startWorker } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';

const seed = Number(process.env.FC_SEED ?? Date.now() % 2 ** 31);
console.log(`serving model test seed: ${seed} (FC_SEED=${seed} replays it)`);

const reqArb = fc.record({
  kind: fc.constantFrom('completion', 'chat', 'bad-json', 'bad-field', 'huge'),
  stream: fc.boolean(),
  words: fc.integer({ min: 0, max: 60 }),
  maxTokens: fc.integer({ min: 1, max: 12 }),
  abortAfterMs: fc.option(fc.integer({ min: 0, max: 40 }), { nil: undefined }),
});

describe.each(['http', 'zmq'] as const)('random batches through the proxy (%s)', (transport) => {
  let workers: Worker[];
  let proxy: ServingProxy;
  beforeAll(async () => {
    workers = await Promise.all(
      ['P0', 'P1', 'D0', 'D1'].map((n) =>
        startWorker({ name: `${n}-m-${transport}`, transport, blocks: 256, leaseMs: 400 }),
      ),
    );
    proxy = await startProxy({
      transport,
      prefill: workers.slice(0, 2).map((w) => w.address),
      decode: workers.slice(2).map((w) => w.address),
      policy: 'least-outstanding',
      maxBodyBytes: 16_384,
      healthIntervalMs: 0,
    });
  });
  afterAll(async () => {
    await proxy.close();
    for (const w of workers) await w.close();
  });

  it('answers right, refuses garbage, frees every block', async () => {
    let n = 0;
    await fc.assert(
      fc.asyncProperty(fc.array(reqArb, { minLength: 1, maxLength: 24 }), async (batch) => {
        await Promise.all(
          batch.map(async (q) => {
            const i = n++;
            const text = `p${i} ${'word '.repeat(q.words)}`;
            const chat = q.kind === 'chat';
            const path = chat ? '/v1/chat/completions' : '/v1/completions';
            const body =
              q.kind === 'bad-json'
                ? '{"prompt": '
                : q.kind === 'bad-field'
                  ? JSON.stringify({ prompt: text, max_tokens: -1 })
                  : q.kind === 'huge'
                    ? JSON.stringify({ prompt: 'z'.repeat(20_000) })
                    : JSON.stringify(
                        chat
                          ? { messages: [{ role: 'user', content: text }], max_tokens: q.maxTokens, stream: q.stream }
                          : { prompt: text, max_tokens: q.maxTokens, stream: q.stream },
                      );
            const ac = new AbortController();
            if (q.abortAfterMs !== undefined) setTimeout(() => ac.abort(), q.abortAfterMs);
            let status: number;
            let got = '';
            try {
              const r = await fetch(`${proxy.url}${path}`, { method: 'POST', body, signal: ac.signal });
              status = r.status;
              const t = await r.text();
              if (status === 200 && q.stream) {
                for (const line of t.split('\n').filter((l) => l.startsWith('data: {'))) {
                  const c = JSON.parse(line.slice(6));
                  expect(c.error, JSON.stringify(c)).toBeUndefined();
                  got += chat ? (c.choices[0].delta.content ?? '') : c.choices[0].text;
                }
                expect(t.endsWith('data: [DONE]\n\n')).toBe(true);
              } else if (status === 200) {
                const j = JSON.parse(t);
                got = chat ? j.choices[0].message.content : j.choices[0].text;
              }
            } catch (e) {
              expect(ac.signal.aborted, String(e)).toBe(true); // only a client that gave up sees no answer
              return;
            }
            if (q.kind === 'bad-json' || q.kind === 'bad-field') expect(status).toBe(400);
            else if (q.kind === 'huge') expect(status).toBe(413);
            else {
              expect(status).toBe(200);
              expect(got).toBe(expectedCompletion(chat ? `user: ${text}` : text, q.maxTokens).join(' '));
            }
          }),
        );
        // Everything settles: nothing in flight, every block back (reads now, abandoned ones by lease).
        await expect.poll(() => workers.every((w) => w.freeBlocks === 256), { timeout: 5000, interval: 50 }).toBe(true);
        // (The proxy hears of a client that gave up a moment after the client does.)
        const outstanding = () => Object.values(proxy.pools).flatMap((p) => p.workers.map((w) => w.outstanding));
        await expect.poll(() => outstanding().every((x) => x === 0), { timeout: 5000, interval: 20 }).toBe(true);
        for (const w of workers) expect(w.stats.badBytes).toBe(0);
      }),
      { seed, numRuns: Number(process.env.FC_RUNS_SERVING ?? 15) },
    );
    expect(proxy.stats.failed).toBe(0);
  }, 120_000);
});
