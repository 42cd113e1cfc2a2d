// What the package sets in UCX's environment before NIXL first loads UCX.
import { execFileSync, spawnSync } from 'node:child_process';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { prepareUcxEnv, setUcxNetDevices, ucxBackendParams } from '../../lib/ucx';
import { ROOT } from '../helpers';

it("UCX's mmap hooks default to 'reloc' (bistro's self-test races the heap), and a user's choice stays", () => {
  // bistro's install test calls brk(+page) then brk(back) while Node's threads
  // allocate: a worker on NIXL died of SIGSEGV in about 1 in 60-250 starts.
  const env: NodeJS.ProcessEnv = {};
  prepareUcxEnv(env);
  expect(env.UCX_MEM_MMAP_HOOK_MODE).toBe('reloc');
  const mine: NodeJS.ProcessEnv = { UCX_MEM_MMAP_HOOK_MODE: 'bistro' };
  prepareUcxEnv(mine);
  expect(mine.UCX_MEM_MMAP_HOOK_MODE).toBe('bistro');
});

it('UCX_TLS without a transport that handles peer failure asks for ucx_error_handling_mode none', () => {
  expect(ucxBackendParams({ UCX_TLS: 'sm,self' })).toEqual({ ucx_error_handling_mode: 'none' });
  expect(ucxBackendParams({ UCX_TLS: 'tcp' })).toBeUndefined();
  expect(ucxBackendParams({})).toBeUndefined();
});

it('--ucx-net-devices sets UCX_NET_DEVICES for the agents a command starts; a malformed list is a usage error', () => {
  const env: NodeJS.ProcessEnv = {};
  setUcxNetDevices('mlx5_0:1, eth0', env);
  expect(env.UCX_NET_DEVICES).toBe('mlx5_0:1,eth0');
  setUcxNetDevices(undefined, env);
  expect(env.UCX_NET_DEVICES).toBe('mlx5_0:1,eth0');
  expect(() => setUcxNetDevices('eth0;rm', env)).toThrow(expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }));
  const bin = path.join(ROOT, 'bin', 'nixl-node.js');
  const info = JSON.parse(
    execFileSync(process.execPath, [bin, 'info', '--json', '--ucx-net-devices=lo'], { encoding: 'utf8' }),
  );
  expect(info.ucx.UCX_NET_DEVICES).toBe('lo');
  for (const cmd of [['info'], ['demo'], ['bench'], ['worker'], ['demo', '--serving']]) {
    const r = spawnSync(process.execPath, [bin, ...cmd, '--ucx-net-devices', 'eth0 eth1'], { encoding: 'utf8' });
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/--ucx-net-devices 'eth0 eth1': expected a comma-separated list/);
  }
});
