// The etcd client behind fleet membership: the `etcd3` package, an optional
// peer dependency loaded only when a worker or proxy is given etcd endpoints.
import type * as Etcd3 from 'etcd3';
import { NixlError } from '../../errors';
import { ETCD3, type EtcdOptions, checkEndpoints } from './etcd';

function loadEtcd3(): typeof Etcd3 {
  try {
    return require('etcd3') as typeof Etcd3;
  } catch {
    throw new NixlError(
      `etcd needs the etcd3 package, which is not installed: npm i -E ${ETCD3}`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  }
}

// Every call goes straight through (no circuit breaker holding a member shut
// for seconds after it returns): our own loops retry at their own pace.
// Async, as cockatiel's policies are: etcd3 calls .catch() on what it returns.
const passThrough = { execute: async <T>(fn: (c: unknown) => T) => fn({ signal: new AbortController().signal }) };
// A watch stream that broke is opened again every 500 ms (etcd3's default
// backs off to 30 s, far longer than a fleet should stay blind).
const every500ms = { duration: 500, next: () => every500ms };

/** An etcd3 client for these endpoints; calls time out after `callTimeoutMs`. */
export function etcdClient(o: EtcdOptions, callTimeoutMs = 2000): Etcd3.Etcd3 {
  const { Etcd3: Client } = loadEtcd3();
  return new Client({
    hosts: checkEndpoints(o.endpoints),
    dialTimeout: callTimeoutMs,
    defaultCallOptions: (ctx) => (ctx.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
    faultHandling: {
      host: () => passThrough as never,
      watchBackoff: every500ms as never,
    },
  });
}
