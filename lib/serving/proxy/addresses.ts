// Worker addresses as the proxy is given them, checked before it starts: an
// address it cannot reach over its transport would otherwise start a proxy
// whose every request is a 503 (or, for ZeroMQ, a socket that never connects).
import { NixlError } from '../../errors';

/** The address, normalised (an HTTP URL without its trailing slash); throws NIXL_ERR_INVALID_PARAM. */
export function checkWorkerAddress(address: string, transport: 'http' | 'zmq', role: string): string {
  const bad = (why: string): never => {
    throw new NixlError(`${role} worker '${address}': ${why}`, 'NIXL_ERR_INVALID_PARAM');
  };
  const scheme = /^([a-z][a-z0-9+.-]*):\/\//i.exec(address)?.[1]?.toLowerCase();
  if (!scheme) {
    const example = transport === 'http' ? `http://${address}` : `tcp://${address}`;
    return bad(`no scheme (write ${example})`);
  }
  if (transport === 'http') {
    if (scheme === 'tcp' || scheme === 'ipc')
      bad('a ZeroMQ address, but the transport is http (use --transport zmq, or the worker’s http:// URL)');
    if (scheme !== 'http' && scheme !== 'https') bad('the http transport takes http:// or https:// URLs');
    const m = /^https?:\/\/(\[[0-9a-f:.]+\]|[^/:?#[\]]+)(?::([^/?#]*))?([^?#]*)$/i.exec(address);
    if (!m) return bad('expected http://host:port (no query or fragment)');
    if (m[2] !== undefined) portOf(m[2], bad);
    return address.replace(/\/+$/, '');
  }
  if (scheme === 'http' || scheme === 'https')
    bad('an HTTP URL, but the transport is zmq (use --transport http, or the worker’s tcp:// address)');
  if (scheme === 'ipc') {
    if (address.length <= 'ipc://'.length) bad('no path');
    return address;
  }
  if (scheme !== 'tcp') bad('the zmq transport takes tcp:// or ipc:// addresses');
  const m = /^tcp:\/\/(\[[0-9a-f:.]+\]|[^:/[\]]+):([^:/]*)$/i.exec(address);
  if (!m) return bad('expected tcp://host:port');
  portOf(m[2], bad);
  return address;
}

function portOf(s: string, bad: (why: string) => never): number {
  const port = Number(s);
  if (!/^\d{1,5}$/.test(s) || port < 1 || port > 65535) bad(`port '${s}' is not a number from 1 to 65535`);
  return port;
}
