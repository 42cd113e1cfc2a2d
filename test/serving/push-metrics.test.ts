// Push mode's transfers in vLLM's vllm:nixl_* series: vLLM counts a NIXL
// transfer on the side that posts it (NixlKVConnectorStats.record_transfer
// when its handle is done), so in push mode the prefill records its WRITEs
// (the push worker's _pop_done_transfers over its sending transfers) and the
// decode, which posts nothing, records none; in pull mode the decode records
// its READs.
import { afterEach, describe, expect, it } from 'vitest';
import type { Worker } from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';
import { serveTrio } from '../helpers';
import { families, sample } from './vllm-series';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

async function transfers(w: Worker) {
  const f = families((await w.metrics!.scrape()).text);
  return {
    count: sample(f, 'vllm:nixl_xfer_time_seconds', 'vllm:nixl_xfer_time_seconds_count'),
    posts: sample(f, 'vllm:nixl_post_time_seconds', 'vllm:nixl_post_time_seconds_count'),
    bytes: sample(f, 'vllm:nixl_bytes_transferred', 'vllm:nixl_bytes_transferred_sum'),
    descriptors: sample(f, 'vllm:nixl_num_descriptors', 'vllm:nixl_num_descriptors_sum'),
    failed: sample(f, 'vllm:nixl_num_failed_transfers_total'),
    ours: sample(f, 'nixl_node_transfers_total'),
  };
}

describe.each(['push', 'pull'] as const)('%s mode', (kvMode) => {
  it(`the side that posts the transfers counts them (${kvMode === 'push' ? 'the prefill' : 'the decode'})`, async () => {
    const w = (name: string) => ({ name: `${name}-${kvMode}`, blocks: 64, kvMode });
    const { proxy, prefill, decode } = await serveTrio(cleanup, {
      prefill: w('xm-P'),
      decode: w('xm-D'),
      proxy: { kvMode, timeoutMs: { prefill: 10_000, decode: 10_000 } },
    });
    const asks = 2;
    for (let i = 0; i < asks; i++) {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({
          model: MODEL_NAME,
          prompt: `request ${i}: ${'several blocks of prompt '.repeat(6)}`,
          max_tokens: 3,
        }),
      });
      expect(r.status).toBe(200);
      await r.json();
    }
    const [poster, other] = kvMode === 'push' ? [prefill, decode] : [decode, prefill];
    const p = await transfers(poster);
    // One WRITE (READ) per request to the one rank: each counted, with its post time, bytes and descriptors.
    expect(p.count).toBe(asks);
    expect(p.posts).toBe(asks);
    expect(p.ours).toBe(asks);
    expect(p.bytes).toBeGreaterThan(0);
    expect(p.descriptors).toBeGreaterThan(0);
    expect(p.failed).toBe(0);
    expect((await transfers(other)).count).toBe(0);
  });
});
