// The precise policy's decision: the prefill holding the longest run of the
// prompt's leading blocks wins unless load outweighs it (prefix 2, KV 1,
// queue 1), each decision leaves a speculative entry, and a worker leaving
// the pool takes its index with it.
import { describe, expect, it } from 'vitest';
import { PreciseRouting, parseEventEndpoint } from '../../lib/serving/kv-index/precise';
import { WorkerPool } from '../../lib/serving/proxy/pool';

const text = 'a prompt of exactly forty-eight bytes, 3 blocks!';

function pool(): { p: WorkerPool; r: PreciseRouting } {
  const p = new WorkerPool('prefill', ['http://a', 'http://b', 'http://c'], 'precise');
  const r = new PreciseRouting({ blockSize: 16 });
  p.router = r;
  const tokens = Array.from(Buffer.from(text));
  r.index.apply('http://b', [
    {
      type: 'BlockStored',
      blockHashes: [1n, 2n],
      parent: null,
      tokenIds: tokens.slice(0, 32),
      blockSize: 16,
      medium: 'GPU',
      loraName: null,
    },
  ]);
  return { p, r };
}

describe('precise policy', () => {
  it('sends a prompt to the prefill holding its leading blocks and says how many tokens matched', () => {
    const { p, r } = pool();
    const hint = r.hint({ prompt: text })!;
    expect(hint.keys.length).toBe(3);
    expect(p.pick(new Set(), hint)?.address).toBe('http://b');
    expect(PreciseRouting.annotation(hint)).toEqual({ prefill: 'http://b', prefix_match_tokens: 32 });
    expect(r.stats['decisions:prefix']).toBe(1);
    // The speculative entry: the third block now counts for b too.
    const again = r.hint({ prompt: text })!;
    p.pick(new Set(), again);
    expect(again.prefixMatchTokens).toBe(48);
  });

  it('load outweighs a partial prefix: a busy holder loses to idle workers', () => {
    const { p, r } = pool();
    p.workers[1].outstanding = 10; // b: queue score 0
    const hint = r.hint({ prompt: `${text.slice(0, 16)}${'x'.repeat(32)}` })!; // b holds 1 of 3 blocks
    // b: 2 x 1/3 + 1 + 0 = 1.67; a and c: 0 + 1 + 1 = 2.
    expect(p.pick(new Set(), hint)?.address).not.toBe('http://b');
  });

  it('a prompt nobody holds goes by load, in turn; one it cannot tokenize too, counted', () => {
    const { p, r } = pool();
    const seen = new Set<string>();
    for (let i = 0; i < 3; i++)
      seen.add(p.pick(new Set(), r.hint({ prompt: `${i} unheld ${'y'.repeat(40)}` }))!.address);
    expect(seen.size).toBe(3);
    expect(r.hint({})).toBeUndefined();
    p.pick(new Set(), undefined);
    expect(r.stats).toMatchObject({ 'decisions:load': 3, 'decisions:no_tokens': 1 });
  });

  it('a worker leaving the pool drops its index', () => {
    const { p, r } = pool();
    expect(r.index.size).toBe(2);
    p.remove(p.workers[1]);
    expect(r.index.size).toBe(0);
  });

  it('parses --kv-events-endpoint and refuses what is not WORKER=PUB[,REPLAY]', () => {
    expect(parseEventEndpoint('http://h:1=tcp://h:5557,tcp://h:5558')).toEqual([
      'http://h:1',
      { pub: 'tcp://h:5557', replay: 'tcp://h:5558' },
    ]);
    expect(parseEventEndpoint('w=tcp://h:5557')).toEqual(['w', { pub: 'tcp://h:5557' }]);
    for (const bad of ['tcp://h:5557', 'w=', 'w=http://h', 'w=tcp://a,tcp://b,tcp://c', 'w=tcp://a,x'])
      expect(() => parseEventEndpoint(bad)).toThrow(/--kv-events-endpoint/);
  });
});

describe("precise policy with a worker's /tokenize", () => {
  it('keys the prompt by the ids a prefill tokenizes it into, and routes by load when none answers', async () => {
    const http = await import('node:http');
    const asked: unknown[] = [];
    const server = http.createServer((req, res) => {
      let body = '';
      req.on('data', (c) => {
        body += c;
      });
      req.on('end', () => {
        asked.push(JSON.parse(body));
        res.writeHead(req.url === '/tokenize' ? 200 : 404, { 'content-type': 'application/json' });
        // A tokenizer of its own: one id per word, 100 + its length.
        const text = String(JSON.parse(body).prompt ?? '');
        res.end(JSON.stringify({ count: 1, tokens: text.split(' ').map((w) => 100 + w.length) }));
      });
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
    const url = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
    try {
      const p = new WorkerPool('prefill', [url, 'http://127.0.0.1:1'], 'precise');
      const r = new PreciseRouting({ blockSize: 2, tokenizer: 'worker' }, undefined, undefined, p);
      p.router = r;
      r.index.apply('http://127.0.0.1:1', [
        {
          type: 'BlockStored',
          blockHashes: [9n],
          parent: null,
          tokenIds: [101, 102],
          blockSize: 2,
          medium: 'GPU',
          loraName: null,
        },
      ]);
      const hint = await r.hint({ model: 'm', prompt: 'a bb ccc' });
      expect(asked).toEqual([{ model: 'm', prompt: 'a bb ccc' }]);
      expect(hint?.keys.length).toBe(1); // ids 101 102 103: one full block of 2
      expect(p.pick(new Set(), hint)?.address).toBe('http://127.0.0.1:1');
      expect(hint?.prefixMatchTokens).toBe(2);
      // Token-id prompts are not sent anywhere.
      expect((await r.hint({ prompt: [101, 102] }))?.keys.length).toBe(1);
      expect(asked.length).toBe(1);
      // No worker answers: no tokens, load decides.
      server.close();
      p.workers[0].healthy = false;
      expect(await r.hint({ model: 'm', prompt: 'x y' })).toBeUndefined();
    } finally {
      server.close();
    }
  });
});
