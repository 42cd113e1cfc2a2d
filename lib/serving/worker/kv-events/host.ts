// The host a worker's KV-event endpoints are advertised at (its /health and
// etcd record). A publisher bound on a wildcard (tcp://*:5557, 0.0.0.0, ::)
// is reached at the worker's --host; when that is a wildcard too, at an
// address of this machine as vLLM picks one (VLLM_HOST_IP, else the first
// non-internal interface address, IPv4 first), never the wildcard itself,
// which a consumer elsewhere cannot connect to.
import * as os from 'node:os';

const WILDCARD_HOSTS = new Set(['', '*', '0.0.0.0', '::', '[::]']);

export const isWildcardHost = (host: string): boolean => WILDCARD_HOSTS.has(host);

/** An address of this machine a peer can reach. */
export function machineHost(): string {
  const env = process.env.VLLM_HOST_IP;
  if (env && !isWildcardHost(env)) return env;
  const addrs = Object.values(os.networkInterfaces())
    .flat()
    .filter((i): i is os.NetworkInterfaceInfo => !!i && !i.internal);
  const v4 = addrs.find((i) => i.family === 'IPv4');
  const v6 = addrs.find((i) => i.family === 'IPv6' && !i.address.startsWith('fe80'));
  return v4?.address ?? v6?.address ?? os.hostname();
}

/** A bound address as a peer connects to it: a wildcard host becomes `host` (a wildcard itself: machineHost()). */
export function connectable(bound: string, host: string): string {
  const h = isWildcardHost(host) ? machineHost() : host;
  return bound.replace(/^tcp:\/\/(0\.0\.0\.0|\*|\[::\]|::)(?=:)/, `tcp://${h.includes(':') ? `[${h}]` : h}`);
}
