// The proxy's conversation cache: single use, expiring with the decode's
// hold (less a margin), bounded in number (the least recently stored go).
import { describe, expect, it } from 'vitest';
import { Conversations, carryTurn, takeConversationId } from '../../lib/serving/proxy/conversations';

const P = (n: number) => ({ remote_request_id: `turn-${n}`, remote_block_ids: [[n]] });

describe('Conversations', () => {
  it('an entry is used once, and given to the prefill as do_remote_decode', () => {
    const c = new Conversations();
    c.put('a', { ...P(1), do_remote_decode: true, do_remote_prefill: false });
    expect(c.take('a')).toEqual({ ...P(1), do_remote_decode: true, do_remote_prefill: false });
    expect(c.take('a')).toBeUndefined();
    expect(c.take('never')).toBeUndefined();
    expect([c.hits, c.misses]).toEqual([1, 2]);
  });

  it("expires with the decode's hold less the margin, or the default TTL when the decode does not say", () => {
    let now = 0;
    const c = new Conversations({ ttlMs: 100_000, marginMs: 5000, now: () => now });
    c.put('held', P(1), 20_000);
    c.put('unsaid', P(2));
    c.put('too-short', P(3), 4000);
    expect(c.size).toBe(2);
    now = 14_999;
    expect(c.take('held')).toBeDefined();
    c.put('held', P(4), 20_000);
    now = 14_999 + 15_000;
    expect(c.take('held')).toBeUndefined();
    now = 99_999;
    expect(c.take('unsaid')).toBeDefined();
    c.put('unsaid', P(5), 1e9); // never longer than the TTL
    now += 100_000;
    expect(c.take('unsaid')).toBeUndefined();
  });

  it('holds at most max entries: the least recently stored go first', () => {
    const c = new Conversations({ max: 3 });
    for (let i = 0; i < 5; i++) c.put(`c${i}`, P(i));
    expect(c.size).toBe(3);
    expect(c.take('c0')).toBeUndefined();
    expect(c.take('c1')).toBeUndefined();
    c.put('c2', P(9)); // stored again: now the newest
    c.put('c5', P(5));
    expect(c.take('c3')).toBeUndefined();
    expect(c.take('c2')?.remote_request_id).toBe('turn-9');
  });

  it("an entry that goes unused (evicted, replaced, found expired) frees the decode's hold; one taken does not", () => {
    let now = 0;
    const dropped: string[] = [];
    const c = new Conversations({ max: 2, ttlMs: 1000, marginMs: 0, now: () => now });
    const put = (id: string, n: number) => c.put(id, P(n), undefined, () => dropped.push(`${id}/${n}`));
    put('a', 1);
    put('b', 2);
    put('c', 3); // evicts a
    put('b', 4); // replaces b's older turn
    expect(dropped).toEqual(['a/1', 'b/2']);
    expect(c.take('c')).toBeDefined();
    now = 2000;
    expect(c.take('b')).toBeUndefined();
    expect(dropped).toEqual(['a/1', 'b/2', 'b/4']);
    // A hold shorter than the margin (5 s by default): never kept.
    new Conversations().put('short', P(5), 4000, () => dropped.push('short'));
    expect(dropped.at(-1)).toBe('short');
  });

  it('claim: the entry, and what frees its hold when the prefill did not read it', () => {
    const dropped: number[] = [];
    const c = new Conversations();
    c.put('a', P(1), undefined, () => dropped.push(1));
    const got = c.claim('a')!;
    expect(got.params.remote_request_id).toBe('turn-1');
    expect(dropped).toEqual([]);
    got.release();
    expect(dropped).toEqual([1]);
    expect(c.claim('a')).toBeUndefined();
  });

  it('conversation_id is taken out of the request, and must be a short string', () => {
    const b: Record<string, unknown> = { prompt: 'x', conversation_id: 'abc' };
    expect(takeConversationId(b)).toBe('abc');
    expect(b).toEqual({ prompt: 'x' });
    expect(takeConversationId({})).toBeUndefined();
    for (const bad of [1, '', 'x'.repeat(257), ['a']])
      expect(() => takeConversationId({ conversation_id: bad })).toThrow(/conversation_id/);
  });

  it("carryTurn keeps the last chunk's params for the conversation and reports the reused tokens", async () => {
    const c = new Conversations();
    const chunks = async function* () {
      yield { choices: [{ text: 'a' }] };
      yield { choices: [{ text: '' }], kv_transfer_params: P(7), nixl_node: { kv_hold_ms: 60_000 } };
    };
    const a = carryTurn({ status: 200, chunks: chunks() }, { conversation: 'z', conversations: c, reusedTokens: 48 });
    const seen = [];
    for await (const x of a.chunks!) seen.push(x);
    expect(seen[1].nixl_node).toEqual({ kv_hold_ms: 60_000, kv_reused_tokens: 48 });
    expect(c.take('z')?.remote_request_id).toBe('turn-7');
    // An error answer is nobody's turn.
    carryTurn({ status: 502, json: { kv_transfer_params: P(8) } }, { conversation: 'y', conversations: c });
    expect(c.size).toBe(0);
  });
});
