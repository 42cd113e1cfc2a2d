// UCX settings a NIXL agent needs to start under the UCX_TLS it runs with.
// UCX's peer-failure handling needs a transport that supports it (tcp, or an
// InfiniBand/RoCE one); with UCX_TLS limited to shared memory (sm, self, cma,
// posix, sysv, xpmem), NIXL's UCX backend fails to start (NIXL_ERR_BACKEND)
// unless ucx_error_handling_mode=none.
import { NixlError } from './errors';
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

/** What UCX logs when it refuses an endpoint because the two agents' error handling differs. */
const UCX_MISMATCH_LOG = 'error handling level mismatch';

/**
 * The ucx_error_handling_mode of an agent's UCX backend: the one it was
 * created with, else NIXL's default (peer); undefined without a UCX backend.
 */
export function ucxErrorMode(agent: {
  getBackendParams(backend: string): { params: Record<string, string> };
}): string | undefined {
  try {
    return agent.getBackendParams('UCX').params.ucx_error_handling_mode ?? 'peer';
  } catch {
    return undefined;
  }
}

/**
 * Why a peer that loaded fine cannot be reached over UCX: agents whose UCX
 * backends run different ucx_error_handling_mode cannot connect (UCX refuses
 * the second endpoint between them: "asymmetric endpoint configuration is not
 * supported, error handling level mismatch"), and NIXL reports only
 * NIXL_ERR_BACKEND or NIXL_ERR_REMOTE_DISCONNECT. `mode` is this agent's.
 */
export function ucxModeHint(mode: string | undefined): string {
  return (
    `agents whose UCX backends run different ucx_error_handling_mode cannot connect (this agent: ${mode ?? 'no UCX backend'}; ` +
    `NIXL's default and vLLM's agents: peer; UCX logs "${UCX_MISMATCH_LOG}" then): ` +
    'give both the same, e.g. backendParams { UCX: { ucx_error_handling_mode } }'
  );
}

/**
 * The error of a loadRemoteMD that NIXL's UCX backend failed (NIXL_ERR_BACKEND:
 * it could not make an endpoint to the peer), naming the setting behind it
 * between two working peers. Other errors pass through.
 */
export function explainLoadFailure(e: unknown, mode: string | undefined): unknown {
  if (!(e instanceof NixlError) || e.code !== 'NIXL_ERR_BACKEND') return e;
  return new NixlError(
    `${e.message}: NIXL's UCX backend could not connect to this peer; ${ucxModeHint(mode)}`,
    e.code,
    e.status,
    {
      cause: e,
    },
  );
}

/**
 * Refuses, before loading them, remote ranks that said (nixl-node's v12 key)
 * they run another ucx_error_handling_mode than this agent: UCX could not
 * connect the two. Ranks that did not say (vLLM's) pass: a mismatch with them
 * shows when loading (explainLoadFailure) or not at all on this side.
 */
export function checkPeerUcxMode(
  agent: { engine: string; getBackendParams(backend: string): { params: Record<string, string> } },
  metas: readonly { engineId: string; nixlNodeUcxErrorHandlingMode?: string }[],
): void {
  if (agent.engine !== 'nixl') return;
  const mine = ucxErrorMode(agent);
  const theirs = metas.find((m) => m.nixlNodeUcxErrorHandlingMode && m.nixlNodeUcxErrorHandlingMode !== mine);
  if (mine === undefined || theirs === undefined) return;
  throw new NixlError(
    `remote engine '${theirs.engineId}' runs ucx_error_handling_mode ${theirs.nixlNodeUcxErrorHandlingMode}: ${ucxModeHint(mine)}`,
    'NIXL_ERR_MISMATCH',
  );
}

// UCX device names: mlx5_0:1, eth0, bond0.100, ib0; 'all' is UCX's default.
const NET_DEVICE = /^[A-Za-z0-9_.:-]+$/;

/**
 * Sets UCX_NET_DEVICES (which NICs UCX may use) for NIXL agents this process
 * starts later: UCX reads it once, when NIXL first loads it. A comma-separated
 * list such as `mlx5_0:1` or `eth0`; undefined leaves the environment as it is.
 * Throws NIXL_ERR_INVALID_PARAM on a malformed list.
 */
export function setUcxNetDevices(list: string | undefined, env: NodeJS.ProcessEnv = process.env): void {
  if (list === undefined) return;
  const devices = list.split(',').map((d) => d.trim());
  if (devices.some((d) => !NET_DEVICE.test(d)))
    throw new NixlError(
      `--ucx-net-devices '${list}': expected a comma-separated list of UCX devices (e.g. mlx5_0:1,eth0)`,
      'NIXL_ERR_INVALID_PARAM',
    );
  env.UCX_NET_DEVICES = devices.join(',');
}
