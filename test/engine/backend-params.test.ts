// NIXL 1.4's getBackendParams and queryXferBackend: what a created backend
// runs with, and which backend serves a request; `nixl-node info --json`
// shows every engine's.
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import { afterEach, expect, it } from 'vitest';
import { NixlAgent, engines } from '../../lib';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const { setupAgent } = require('../fixtures/conformance-setup.js');
import { ROOT } from '../helpers';

const agents: NixlAgent[] = [];
afterEach(() => {
  for (const a of agents.splice(0)) a.close();
});

it("the loopback backend's parameters are its own, with its memory types; a backend not created is NOT_FOUND", () => {
  const a = new NixlAgent('bp-a', { engine: 'loopback', captureTelemetry: true });
  agents.push(a);
  const p = a.getBackendParams('LOOPBACK');
  expect(p.memTypes).toEqual(['DRAM']);
  expect(p.params).toMatchObject({ worker_threads: '1', max_notif_bytes: '65536', capture_telemetry: 'true' });
  expect(() => a.getBackendParams('UCX')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
  const none = new NixlAgent('bp-none', { engine: 'loopback', backends: [] });
  agents.push(none);
  expect(() => none.getBackendParams('LOOPBACK')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
});

it('queryXferBackend names the backend of a request, and refuses a released one', () => {
  const a = new NixlAgent('bq-a', { engine: 'loopback' });
  const b = new NixlAgent('bq-b', { engine: 'loopback' });
  agents.push(a, b);
  const mine = Buffer.alloc(4096);
  const theirs = Buffer.alloc(4096, 7);
  a.registerMemory(mine);
  b.registerMemory(theirs);
  a.addRemoteAgent(b.getAgentMetadata());
  const h = a.initializeXfer('READ', mine, theirs, 'bq-b');
  expect(a.queryXferBackend(h)).toBe('LOOPBACK');
  a.releaseXferHandle(h);
  expect(() => a.queryXferBackend(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
});

it.skipIf(!engines.includes('nixl'))(
  "on NIXL: the UCX backend's parameters as NIXL reports them, and queryXferBackend names UCX",
  async () => {
    const a: NixlAgent = setupAgent(NixlAgent, 'bpn-a', 'nixl');
    const b: NixlAgent = setupAgent(NixlAgent, 'bpn-b', 'nixl');
    agents.push(a, b);
    const p = a.getBackendParams('UCX');
    expect(p.memTypes).toContain('DRAM');
    expect(p.params.ucx_error_handling_mode).toBe('none');
    expect(() => a.getBackendParams('LOOPBACK')).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
    const mine = Buffer.alloc(4096);
    const theirs = Buffer.alloc(4096, 7);
    a.registerMemory(mine);
    b.registerMemory(theirs);
    a.addRemoteAgent(b.getAgentMetadata());
    const h = a.initializeXfer('READ', mine, theirs, 'bpn-b');
    expect(a.queryXferBackend(h)).toBe('UCX');
    a.transfer(h);
    await a.wait(h, { timeoutMs: 10_000 });
    expect(mine.every((x) => x === 7)).toBe(true);
    a.releaseXferHandle(h);
    expect(() => a.queryXferBackend(h)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_NOT_FOUND' }));
  },
  30_000,
);

it('nixl-node info --json shows backendParams of every engine compiled in, loopback included', () => {
  const info = JSON.parse(
    execFileSync(process.execPath, [path.join(ROOT, 'bin', 'nixl-node.js'), 'info', '--json'], { encoding: 'utf8' }),
  );
  expect(info.backendParams.loopback.LOOPBACK.memTypes).toEqual(['DRAM']);
  expect(info.backendParams.loopback.LOOPBACK.params.worker_threads).toBe('1');
  if (info.engines.includes('nixl')) expect(Object.keys(info.backendParams.nixl)).toContain('UCX');
  expect(info.statusCodes).toMatch(/NIXL/);
});
