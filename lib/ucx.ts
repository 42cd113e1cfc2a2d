// UCX settings a NIXL agent needs to start under the UCX_TLS it runs with.
// UCX's peer-failure handling needs a transport that supports it (tcp, or an
// InfiniBand/RoCE one); with UCX_TLS limited to shared memory (sm, self, cma,
// posix, sysv, xpmem), NIXL's UCX backend fails to start (NIXL_ERR_BACKEND)
// unless ucx_error_handling_mode=none.
const HANDLES_PEER_FAILURE = /(^|[,^])(all|tcp|rc\w*|ud\w*|dc\w*|ib)(,|$)/;

/**
 * Sets what UCX reads when NIXL first loads it, unless the user set it.
 *
 * UCX_MEM_MMAP_HOOK_MODE=reloc: UCX's default 'bistro' hooks are installed
 * when libucm is loaded, and they test themselves in "exclusive" mode. The
 * test calls brk(current + page) and then brk(current), on the assumption that
 * no other thread runs yet. Here NIXL loads UCX with dlopen into a Node
 * process whose V8 and libuv threads are already allocating. A malloc that
 * grows the heap between the two brk calls loses the pages it just got. The
 * process then dies of SIGSEGV at its next touch of them, often in V8's lazy
 * compiler. A core of such a crash shows a one-page hole at the top of the brk
 * heap. It hit about 1 in 60-250 starts of a worker under load here. 'reloc'
 * hooks install without that test; NIXL's own transfers use memory it
 * registered, not UCX's registration cache, so nothing it needs is lost.
 */
export function prepareUcxEnv(env: NodeJS.ProcessEnv = process.env): void {
  if (env.UCX_MEM_MMAP_HOOK_MODE === undefined) env.UCX_MEM_MMAP_HOOK_MODE = 'reloc';
}

/** Backend params for NIXL's UCX plugin under this environment's UCX_TLS (none needed: undefined). */
export function ucxBackendParams(env: NodeJS.ProcessEnv = process.env): Record<string, string> | undefined {
  const tls = env.UCX_TLS;
  if (tls === undefined || tls === '' || HANDLES_PEER_FAILURE.test(tls)) return undefined;
  return { ucx_error_handling_mode: 'none' };
}

// UCX device names: mlx5_0:1, eth0, bond0.100, ib0; 'all' is UCX's default.
const NET_DEVICE = /^[A-Za-z0-9_.:-]+$/;

/**
 * Sets UCX_NET_DEVICES (which NICs UCX may use) for NIXL agents this process
 * starts later: UCX reads it once, when NIXL first loads it. A comma-separated
 * list such as `mlx5_0:1` or `eth0`; undefined leaves the environment as it is.
 * Throws RangeError on a malformed list.
 */
export function setUcxNetDevices(list: string | undefined, env: NodeJS.ProcessEnv = process.env): void {
  if (list === undefined) return;
  const devices = list.split(',').map((d) => d.trim());
  if (devices.some((d) => !NET_DEVICE.test(d)))
    throw new RangeError(
      `--ucx-net-devices '${list}': expected a comma-separated list of UCX devices (e.g. mlx5_0:1,eth0)`,
    );
  env.UCX_NET_DEVICES = devices.join(',');
}
