// --served-model-name with several names behind the proxy: the proxy learns
// every name a worker serves (its /health or HEALTH reply, or its etcd
// record), routes a request for any of them to the workers that serve it,
// answers with the name asked for (as vLLM does) and lists every name in
// /v1/models; a name nobody serves is still a 404 listing those that are.
import { afterEach, describe, expect, it } from 'vitest';
import { parseRecord, servedNamesField } from '../../lib/serving/fleet/record';
import { serveTrio } from '../helpers';

const cleanup: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

const NAMES = ['acme/llm-7b', 'acme-llm', 'llm'];

describe.each(['http', 'zmq'] as const)('aliases through the proxy over %s', (transport) => {
  it('a request for any served name is routed, answered under that name; /v1/models lists them all', async () => {
    const w = (name: string) => ({ name: `${name}-${transport}`, blocks: 64, servedModelNames: NAMES });
    const { proxy } = await serveTrio(cleanup, { transport, prefill: w('alias-P'), decode: w('alias-D') });
    // The proxy learns what each worker serves from its health answer.
    await proxy.checkHealth();
    for (const model of NAMES) {
      const r = await fetch(`${proxy.url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ model, prompt: 'the same prompt under another name', max_tokens: 3 }),
      });
      expect(r.status, model).toBe(200);
      const body = (await r.json()) as { model: string; nixl_node: Record<string, unknown> };
      expect(body.model).toBe(model);
    }
    const chat = await fetch(`${proxy.url}/v1/chat/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: 'llm', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }),
    });
    expect(chat.status).toBe(200);
    expect(((await chat.json()) as { model: string }).model).toBe('llm');
    const models = (await (await fetch(`${proxy.url}/v1/models`)).json()) as { data: Array<{ id: string }> };
    expect(models.data.map((m) => m.id)).toEqual(NAMES);
    const other = await fetch(`${proxy.url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: 'someone-else', prompt: 'x', max_tokens: 1 }),
    });
    expect(other.status).toBe(404);
    expect(((await other.json()) as { error: { message: string } }).error.message).toContain('acme-llm');
  });
});

describe('served names in the etcd record', () => {
  const rec = {
    v: 1,
    name: 'w0',
    role: 'both',
    model: 'acme/llm-7b',
    address: 'http://127.0.0.1:8001',
    transport: 'http',
    freeBlocks: 1,
    totalBlocks: 2,
    load: 0,
  };

  it('a record lists the aliases; one name alone adds nothing', () => {
    expect(servedNamesField(NAMES)).toEqual({ servedModelNames: NAMES });
    expect(servedNamesField(['acme/llm-7b'])).toEqual({});
    const r = { ...rec, ...servedNamesField(NAMES) };
    expect(parseRecord(JSON.stringify(r))).toEqual(r);
  });

  it('names that would not fit the record are left out of it (the worker still lists them in /health)', () => {
    const many = Array.from({ length: 20 }, (_, i) => `${'n'.repeat(200)}${i}`);
    expect(servedNamesField(many)).toEqual({});
    expect(servedNamesField(['a', 'with space'])).toEqual({});
  });

  it.each([
    [{ servedModelNames: 'llm' }],
    [{ servedModelNames: [7] }],
    [{ servedModelNames: ['a b'] }],
    [{ servedModelNames: Array.from({ length: 33 }, (_, i) => `m${i}`) }],
  ])('refuses a bad name list (%#)', (bad) => {
    expect(parseRecord(JSON.stringify({ ...rec, ...bad }))).toContain("'servedModelNames'");
  });
});
