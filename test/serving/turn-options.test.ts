// Bidirectional KV's worker options out of range (docs/multiturn.md): a
// decoder KV TTL that is not a positive number of milliseconds, a reuse
// handshake timeout longer than a timer can wait, a recompute threshold that
// is not a count, is refused at start with a typed error, never at the first
// decode (its answer computed, then a 500, and the blocks it took kept). A
// TTL longer than a Node.js timer can wait holds on timers that can.
import { describe, expect, it, vi } from 'vitest';
import { startWorker } from '../../lib/serving';
import { serveTrio } from '../helpers';

const original = globalThis.setTimeout;

describe('bidirectional KV options out of range', () => {
  it.each([
    ['decoderKvTtlMs', 0],
    ['decoderKvTtlMs', -1],
    ['decoderKvTtlMs', Number.NaN],
    ['kvRecomputeThreshold', -1],
    ['kvRecomputeThreshold', 1.5],
    ['kvReuseHandshakeMs', 0],
    ['kvReuseHandshakeMs', Number.POSITIVE_INFINITY],
    ['kvReuseHandshakeMs', 2 ** 31],
  ])('%s: %d is refused at start (NIXL_ERR_INVALID_PARAM)', async (k, v) => {
    await expect(startWorker({ bidirectionalKv: true, [k]: v })).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
    });
  });

  it('checked before a GGUF loads or an agent is made (nothing to leak)', async () => {
    for (const o of [{ heldTurnsShare: 2 }, { decoderKvTtlMs: 0 }, { kvRecomputeThreshold: -1 }])
      await expect(startWorker({ model: '/nonexistent.gguf', bidirectionalKv: true, ...o })).rejects.toMatchObject({
        code: 'NIXL_ERR_INVALID_PARAM',
        message: expect.stringMatching(new RegExp(`^${Object.keys(o)[0]}`)),
      });
  });

  it('a TTL longer than a timer can wait (99 days) holds turns on timers that can, and turn 2 reads turn 1', async () => {
    const closers: Array<() => unknown> = [];
    // Node.js fires a longer timer at once: the hold's timer would wake every millisecond.
    const overflowing: number[] = [];
    const spy = vi.spyOn(globalThis, 'setTimeout').mockImplementation(((
      f: () => void,
      ms?: number,
      ...a: unknown[]
    ) => {
      if (typeof ms === 'number' && ms > 2 ** 31 - 1) overflowing.push(ms);
      return original(f, ms, ...a);
    }) as typeof setTimeout);
    try {
      const w = { bidirectionalKv: true, kvRecomputeThreshold: 16 };
      const { proxy, decode } = await serveTrio(closers, { prefill: w, decode: { ...w, decoderKvTtlMs: 2 ** 33 } });
      const ask = async (prompt: string) => {
        const r = await fetch(`${proxy.url}/v1/completions`, {
          method: 'POST',
          body: JSON.stringify({ prompt, max_tokens: 8, temperature: 0, conversation_id: 'long' }),
        });
        const j = (await r.json()) as { choices: Array<{ text: string }>; nixl_node: { kv_reused_tokens?: number } };
        expect(r.status, JSON.stringify(j)).toBe(200);
        return j;
      };
      const p1 = 'the history of rivers and mountains, '.repeat(8);
      const a = await ask(p1);
      expect(decode.turns!.held).toBe(1);
      const b = await ask(`${p1}${a.choices[0].text} and then?`);
      expect(b.nixl_node.kv_reused_tokens).toBeGreaterThan(0);
      expect(overflowing).toEqual([]);
    } finally {
      spy.mockRestore();
      for (const c of closers.reverse()) await c();
    }
  });
});
