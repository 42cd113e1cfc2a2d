// Turn 2 of a conversation through the proxy: time to first token when its
// prefill reads turn 1's KV from the decode that answered it (bidirectional
// KV, conversation_id), against the same turn recomputed (no conversation),
// for growing histories. The two alternate request by request, so both see
// the same machine. Synthetic model: its "compute" is hashing and filling
// the KV's bytes, so the ratio says what the read and its checks cost
// against that, not what a real model saves.
import { type WorkerOptions, startProxy, startWorker } from '../lib/serving';
import { median } from './stats';

export interface MultiturnRow {
  /** History tokens (the synthetic model's tokens are bytes). */
  historyTokens: number;
  reusedTokens: number;
  reuseMs: number;
  reuseMin: number;
  reuseMax: number;
  recomputeMs: number;
  recomputeMin: number;
  recomputeMax: number;
  /** reuse / recompute (medians). */
  ratio: number;
}

/** Time to the first streamed text of one request, the tokens its prefill reused, and what the decode said. */
export async function firstToken(
  url: string,
  body: object,
): Promise<{ ms: number; reused: number; text: string; info: Record<string, unknown> }> {
  const t0 = performance.now();
  const r = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, stream: true }),
  });
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
  const reader = r.body!.getReader();
  const dec = new TextDecoder();
  let raw = '';
  let ms = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    raw += dec.decode(value, { stream: true });
    if (!ms && raw.includes('"text":"') && /"text":"[^"]/.test(raw)) ms = performance.now() - t0;
  }
  const chunks = raw
    .split('\n\n')
    .filter((l) => l.startsWith('data: {'))
    .map((l) => JSON.parse(l.slice(6)));
  const last = chunks.at(-1);
  const text = chunks.map((c) => c.choices?.[0]?.text ?? '').join('');
  return { ms, reused: Number(last?.nixl_node?.kv_reused_tokens ?? 0), text, info: last?.nixl_node ?? {} };
}

/** `n` turn-2 requests each way per history size. */
export async function benchMultiturn(n: number, sizes: readonly number[]): Promise<MultiturnRow[]> {
  const blocks = Math.ceil((Math.max(...sizes) * 4) / 16) + 64;
  const proxy = await conversationCluster('bench-mt', { blocks });
  const rows: MultiturnRow[] = [];
  try {
    let conv = 0;
    for (const size of sizes) {
      const reuse: number[] = [];
      const recompute: number[] = [];
      let reused = 0;
      for (let i = 0; i < n + 1; i++) {
        // A fresh conversation each time: turn 1, then turn 2 with reuse; the same turn 2 recomputed.
        const id = `bench-${++conv}`;
        const history = `user: ${`history ${i} `.repeat(Math.ceil(size / 9))}`.slice(0, size);
        const t1 = await firstToken(proxy.url, { prompt: history, max_tokens: 16, conversation_id: id });
        const turn2 = `${history}${t1.text}\nuser: and then?\n`;
        const a = await firstToken(proxy.url, { prompt: turn2, max_tokens: 16, conversation_id: id });
        const b = await firstToken(proxy.url, { prompt: turn2, max_tokens: 16 });
        if (a.text !== b.text) throw new Error(`turn 2 answered differently with reuse (history ${size})`);
        if (i === 0) continue; // warm-up: handshakes
        reuse.push(a.ms);
        recompute.push(b.ms);
        reused = a.reused;
      }
      rows.push({ historyTokens: size, reusedTokens: reused, ...turnTimes(reuse, recompute) });
    }
  } finally {
    await proxy.close();
  }
  return rows;
}

/** Median and range of turn 2 with reuse and recomputed, and the ratio of their medians. */
export function turnTimes(reuse: number[], recompute: number[]) {
  const [ru, rc] = [median(reuse), median(recompute)];
  return {
    reuseMs: ru,
    reuseMin: Math.min(...reuse),
    reuseMax: Math.max(...reuse),
    recomputeMs: rc,
    recomputeMin: Math.min(...recompute),
    recomputeMax: Math.max(...recompute),
    ratio: ru / rc,
  };
}

/**
 * A bidirectional prefill and decode (`name`-p, `name`-d) behind a proxy that
 * remembers one conversation, so the previous one's hold is freed when the
 * next one starts. close() closes all three.
 */
export async function conversationCluster(
  name: string,
  o: WorkerOptions,
): Promise<{ url: string; close(): Promise<void> }> {
  const opts = { bidirectionalKv: true, decoderKvTtlMs: 60_000, ...o };
  const p = await startWorker({ ...opts, name: `${name}-p` });
  const d = await startWorker({ ...opts, name: `${name}-d` });
  const proxy = await startProxy({
    prefill: [p.address],
    decode: [d.address],
    healthIntervalMs: 0,
    conversations: { max: 1 },
  });
  return {
    url: proxy.url,
    close: async () => {
      await proxy.close();
      await p.close();
      await d.close();
    },
  };
}
