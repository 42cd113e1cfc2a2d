// UCX settings a NIXL agent needs to start under the UCX_TLS it runs with.
// UCX's peer-failure handling needs a transport that supports it (tcp, or an
// InfiniBand/RoCE one); with UCX_TLS limited to shared memory (sm, self, cma,
// posix, sysv, xpmem), NIXL's UCX backend fails to start (NIXL_ERR_BACKEND)
// unless ucx_error_handling_mode=none.
const HANDLES_PEER_FAILURE = /(^|[,^])(all|tcp|rc\w*|ud\w*|dc\w*|ib)(,|$)/;

/** Backend params for NIXL's UCX plugin under this environment's UCX_TLS (none needed: undefined). */
export function ucxBackendParams(env: NodeJS.ProcessEnv = process.env): Record<string, string> | undefined {
  const tls = env.UCX_TLS;
  if (tls === undefined || tls === '' || HANDLES_PEER_FAILURE.test(tls)) return undefined;
  return { ucx_error_handling_mode: 'none' };
}
