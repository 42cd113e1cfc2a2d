// Where the precise policy sends a prompt no prefill holds: while the index
// knows what the prefills hold, new prefixes spread by load and then by the
// blocks each prefill holds (llm-d's KV-utilisation score, from the index
// when workers report none), not by the 'load' policy's rendezvous hashing,
// which can pile several new prefixes onto one prefill whose contexts then
// evict each other. With no events from any prefill, the prefix affinity
// still places them.
import { describe, expect, it } from 'vitest';
import { affinityOrder } from '../../lib/serving/fleet/routing';
import { promptKeys } from '../../lib/serving/kv-index/index';
import { PreciseRouting } from '../../lib/serving/kv-index/precise';
import { WorkerPool } from '../../lib/serving/proxy/pool';

const ADDRS = ['http://a', 'http://b', 'http://c'];

/** Prompts whose prefix affinity (rendezvous) all prefer http://a. */
function promptsPreferringA(n: number): string[] {
  const out: string[] = [];
  const p = new WorkerPool('prefill', ADDRS, 'load');
  for (let i = 0; out.length < n; i++) {
    const prompt = `${i} new system prompt ${'z'.repeat(40)}`;
    if (affinityOrder(`\n${prompt}`, p.workers)[0].address === 'http://a') out.push(prompt);
  }
  return out;
}

function fleet(withEvents: boolean): { p: WorkerPool; r: PreciseRouting } {
  const p = new WorkerPool('prefill', ADDRS, 'precise');
  const r = new PreciseRouting({ blockSize: 16 });
  p.router = r;
  if (withEvents)
    ADDRS.forEach((a, i) => {
      // Each holds a prompt a decision sent it: its event confirms the proxy keys prompts as the workers do.
      const held = Array.from(Buffer.from(`held by ${i} `.padEnd(32, '.')));
      r.index.speculate(a, promptKeys(held, 16));
      r.index.apply(a, [
        {
          type: 'BlockStored',
          blockHashes: [BigInt(10 * i + 1), BigInt(10 * i + 2)],
          parent: null,
          tokenIds: held,
          blockSize: 16,
          medium: 'GPU',
          loraName: null,
        },
      ]);
    });
  return { p, r };
}

function route(p: WorkerPool, r: PreciseRouting, prompt: string): string {
  const hint = r.hint({ prompt }) as { keys: number[]; affinity?: string };
  return p.pick(new Set(), { ...hint, affinity: `\n${prompt}` })!.address;
}

describe('precise, new prefixes', () => {
  it('spread over the prefills by the blocks each holds, even when their affinity all points at one', () => {
    const { p, r } = fleet(true);
    const sent = promptsPreferringA(6).map((prompt) => route(p, r, prompt));
    const per = ADDRS.map((a) => sent.filter((s) => s === a).length);
    expect(per).toEqual([2, 2, 2]);
    expect(r.stats['decisions:load']).toBe(6);
  });

  it('spread by load first: a busy prefill gets none while others are idle', () => {
    const { p, r } = fleet(true);
    p.workers[2].outstanding = 3;
    const sent = promptsPreferringA(4).map((prompt) => route(p, r, prompt));
    expect(sent).not.toContain('http://c');
    expect(new Set(sent).size).toBe(2);
  });

  it('with no events from any prefill, follow the prefix affinity as the load policy does', () => {
    const { p, r } = fleet(false);
    const sent = promptsPreferringA(4).map((prompt) => route(p, r, prompt));
    expect(new Set(sent)).toEqual(new Set(['http://a']));
  });

  it('with events no decision was confirmed by (prompts tokenized otherwise than the workers), the affinity too', () => {
    const { p, r } = fleet(false);
    for (const [i, a] of ADDRS.entries())
      r.index.apply(a, [
        {
          type: 'BlockStored',
          blockHashes: [BigInt(i + 1)],
          parent: null,
          tokenIds: Array.from({ length: 16 }, (_, t) => 1000 + t + i),
          blockSize: 16,
          medium: 'GPU',
          loraName: null,
        },
      ]);
    const sent = promptsPreferringA(4).map((prompt) => route(p, r, prompt));
    expect(new Set(sent)).toEqual(new Set(['http://a']));
  });
});
