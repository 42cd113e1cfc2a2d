// What the package sets in UCX's environment before NIXL first loads UCX.
import { expect, it } from 'vitest';
import { prepareUcxEnv, ucxBackendParams } from '../lib/ucx';

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
