// A worker's POST /v1/kv/release body against its schema
// (docs/kv-release-request.schema.json): ids of another type are a 400
// naming the field, as every other body's.
import { afterEach, describe, expect, it } from 'vitest';
import { startWorker } from '../../lib/serving';

type Body = Record<string, unknown>;

describe("a worker's /v1/kv/release body", () => {
  const closers: Array<() => unknown> = [];
  afterEach(async () => {
    for (const c of closers.splice(0).reverse()) await c();
  });

  it('ids are strings: another type is a 400 naming it, an unknown id releases nothing', async () => {
    const prefill = await startWorker({ transport: 'http' });
    closers.push(() => prefill.close());
    const post = async (body: unknown) => {
      const r = await fetch(`${prefill.address}/v1/kv/release`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(body),
      });
      return { status: r.status, json: (await r.json()) as Body };
    };
    expect(await post({ remote_request_id: 'nobody' })).toEqual({ status: 200, json: { released: false } });
    for (const [field, v] of [
      ['remote_request_id', 7],
      ['request_id', { a: 1 }],
      ['remote_request_id', 'x'.repeat(300)],
    ] as const) {
      const r = await post({ [field]: v });
      expect(r.status, `${field}=${JSON.stringify(v)}`).toBe(400);
      expect(r.json.error).toMatchObject({ type: 'invalid_request_error', param: field });
    }
  });
});
