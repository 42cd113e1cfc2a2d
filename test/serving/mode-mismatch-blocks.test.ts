// A pull worker asked for push (kv_transfer_params with transfer_mode
// 'push') refuses with kv_mode_mismatch before it evaluates the prompt or
// takes blocks: every block stays free, on the prefill and the decode leg.
import { afterEach, expect, it } from 'vitest';
import { startWorker } from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

it('a pull worker refuses push params without holding a block', async () => {
  const w = await startWorker({ name: 'mismatch-pull', transport: 'http', blocks: 64 });
  cleanup.push(() => w.close());
  const total = w.freeBlocks;
  const legs = [
    { do_remote_decode: true, do_remote_prefill: false, transfer_mode: 'push', transfer_id: 'x1' },
    {
      do_remote_prefill: true,
      do_remote_decode: false,
      transfer_mode: 'push',
      transfer_id: 'x2',
      remote_engine_id: 'elsewhere',
      remote_host: '127.0.0.1',
      remote_port: 1,
    },
  ];
  for (let i = 0; i < 6; i++) {
    const r = await fetch(`${w.address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({
        model: MODEL_NAME,
        prompt: `a prompt long enough to need blocks ${i} `.repeat(8),
        max_tokens: 3,
        kv_transfer_params: legs[i % 2],
      }),
    });
    const body = (await r.json()) as { error?: { type?: string } };
    expect(r.status, JSON.stringify(body)).toBe(400);
    expect(body.error?.type).toBe('kv_mode_mismatch');
  }
  expect(w.freeBlocks).toBe(total);
});
