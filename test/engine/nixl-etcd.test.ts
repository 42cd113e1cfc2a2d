// NIXL's own metadata exchange through etcd (NIXL_ETCD_ENDPOINTS): partial
// metadata goes to etcd under a label, which NIXL requires there
// (nixl_etcd_metadata_backend.cpp: NIXL_ERR_INVALID_PARAM without one), and
// a fetch reads it with the same label. The binding checks labels before
// NIXL sees them. Against a real etcd, beside a fleet's keys, when the addon
// has the NIXL engine and NIXL was built with etcd (else skipped, saying why).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { NixlAgent, allocate, engines } from '../../lib';
import { ETCD_MISSING, EtcdServer } from '../etcd-server';

const code = (f: () => unknown): string | undefined => {
  try {
    f();
  } catch (e) {
    return (e as { code?: string }).code;
  }
  return undefined;
};

describe('metadata labels (loopback engine)', () => {
  const a = new NixlAgent('label-a', { engine: 'loopback' });
  const m = allocate(4096);
  a.registerMemory(m);
  afterAll(() => a.close());

  it('partial metadata to the metadata server (no ip) needs a label, as NIXL does', () => {
    expect(() => a.sendPartialAgentMetadata(m)).toThrow(/needs a label/);
    expect(code(() => a.sendPartialAgentMetadata(m))).toBe('NIXL_ERR_INVALID_PARAM');
    // With one, the call reaches the engine: the loopback engine has no metadata service.
    expect(code(() => a.sendPartialAgentMetadata(m, { label: 'kv-0' }))).toBe('NIXL_ERR_NOT_SUPPORTED');
    expect(code(() => a.sendPartialAgentMetadata(m, { label: 'kv-0', includeConnInfo: true, backends: ['UCX'] }))).toBe(
      'NIXL_ERR_NOT_SUPPORTED',
    );
    // To a peer's listener NIXL ignores labels: none needed.
    expect(code(() => a.sendPartialAgentMetadata(m, { ip: '127.0.0.1', port: 1 }))).toBe('NIXL_ERR_NOT_SUPPORTED');
    expect(code(() => a.fetchRemoteMetadata('x', { label: 'kv-0' }))).toBe('NIXL_ERR_NOT_SUPPORTED');
  });

  it.each([
    ['empty', ''],
    ["with a '/'", 'a/b'],
    ['with a NUL', 'nul\0'],
    ['of 257 characters', 'x'.repeat(257)],
    ['a number', 5],
    ['an object', {}],
  ])('a label %s is refused before NIXL sees it', (_, label) => {
    const l = label as string;
    expect(code(() => a.sendPartialAgentMetadata(m, { label: l }))).toBe('NIXL_ERR_INVALID_PARAM');
    expect(code(() => a.fetchRemoteMetadata('x', { label: l }))).toBe('NIXL_ERR_INVALID_PARAM');
  });
});

const skip = !engines.includes('nixl')
  ? ' (SKIPPED: NIXL is not compiled in: build with NIXL_PREFIX=<nixl install>)'
  : ETCD_MISSING;

describe.skipIf(skip !== '')(`NIXL's etcd mode against the fleet's etcd${skip}`, () => {
  let etcd: EtcdServer;
  const ns = `/nixl-node-test-${process.pid}/agents`;
  const saved = { endpoints: process.env.NIXL_ETCD_ENDPOINTS, ns: process.env.NIXL_ETCD_NAMESPACE };
  const agents: NixlAgent[] = [];
  beforeAll(async () => {
    etcd = await new EtcdServer().start();
    // NIXL reads these when an agent is made.
    process.env.NIXL_ETCD_ENDPOINTS = etcd.url;
    process.env.NIXL_ETCD_NAMESPACE = ns;
  }, 30_000);
  afterAll(async () => {
    for (const x of agents) x.close();
    if (saved.endpoints === undefined) delete process.env.NIXL_ETCD_ENDPOINTS;
    else process.env.NIXL_ETCD_ENDPOINTS = saved.endpoints;
    if (saved.ns === undefined) delete process.env.NIXL_ETCD_NAMESPACE;
    else process.env.NIXL_ETCD_NAMESPACE = saved.ns;
    await etcd?.destroy();
  });
  const until = async (f: () => boolean | Promise<boolean>) => {
    for (let i = 0; i < 200; i++) {
      if (await f()) return true;
      await new Promise((r) => setTimeout(r, 50));
    }
    return f();
  };
  const keys = async (): Promise<string[]> => {
    const r = await fetch(`${etcd.url}/v3/kv/range`, {
      method: 'POST',
      body: JSON.stringify({
        key: Buffer.from('/').toString('base64'),
        range_end: Buffer.from('0').toString('base64'),
      }),
    });
    const j = (await r.json()) as { kvs?: Array<{ key: string }> };
    return (j.kvs ?? []).map((kv) => Buffer.from(kv.key, 'base64').toString()).sort();
  };

  const mk = (name: string) => {
    const x = new NixlAgent(name, { engine: 'nixl', backendParams: { UCX: { ucx_error_handling_mode: 'none' } } });
    agents.push(x);
    return x;
  };

  it("full metadata goes through etcd beside the fleet's keys; an invalidation reaches the fetcher", async (ctx) => {
    const a = mk('etcd-a');
    const b = mk('etcd-b');
    const m = allocate(4096);
    a.registerMemory(m);
    // A fleet's key in the same etcd: NIXL's namespace is another.
    await fetch(`${etcd.url}/v3/kv/put`, {
      method: 'POST',
      body: JSON.stringify({
        key: Buffer.from('/nixl-node/workers/w1').toString('base64'),
        value: Buffer.from('{}').toString('base64'),
      }),
    });
    const sent = code(() => a.sendLocalMetadata());
    if (sent === 'NIXL_ERR_NOT_SUPPORTED') return ctx.skip('this NIXL was built without etcd (HAVE_ETCD)');
    expect(sent).toBeUndefined();
    b.fetchRemoteMetadata('etcd-a');
    expect(await until(() => b.checkRemoteMetadata('etcd-a', [m]))).toBe(true);
    expect(await keys()).toEqual(expect.arrayContaining([`${ns}/etcd-a/`, `${ns}/etcd-a/metadata`]));
    a.invalidateLocalMetadata();
    expect(await until(() => !b.checkRemoteMetadata('etcd-a'))).toBe(true);
    const left = await keys();
    expect(left.filter((k) => k.startsWith(`${ns}/etcd-a/`))).toEqual([]);
    expect(left).toContain('/nixl-node/workers/w1');
  }, 60_000);

  it('partial metadata goes to etcd under its label and a fetch with that label loads it', async (ctx) => {
    const a = mk('etcd-p');
    const c = mk('etcd-c');
    const m = allocate(4096);
    a.registerMemory(m);
    const sent = code(() => a.sendPartialAgentMetadata([m], { label: 'kv-1', includeConnInfo: true }));
    if (sent === 'NIXL_ERR_NOT_SUPPORTED') return ctx.skip('this NIXL was built without etcd (HAVE_ETCD)');
    expect(sent).toBeUndefined();
    c.fetchRemoteMetadata('etcd-p', { label: 'kv-1' });
    expect(await until(() => c.checkRemoteMetadata('etcd-p', [m]))).toBe(true);
    expect(await keys()).toEqual(expect.arrayContaining([`${ns}/etcd-p/`, `${ns}/etcd-p/kv-1`]));
    expect(await keys()).not.toContain(`${ns}/etcd-p/metadata`);
    a.invalidateLocalMetadata();
    expect(await until(async () => (await keys()).every((x) => !x.startsWith(`${ns}/etcd-p/`)))).toBe(true);
  }, 60_000);
});
