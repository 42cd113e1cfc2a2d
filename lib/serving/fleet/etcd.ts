// Where a fleet lives in etcd: endpoints and key prefix, checked. The client
// itself is in etcd-client.ts, out of the package's public declarations (they
// would name etcd3's types, which an application without it cannot resolve).

/** The npm package (and version tested) a fleet needs. */
export const ETCD3 = 'etcd3@1.1.2';

/** Where a fleet keeps its members. */
export interface EtcdOptions {
  /** etcd client URLs (http://host:2379), one or more members of one cluster. */
  endpoints: string[];
  /** Key prefix shared by a fleet's workers and proxies (default /nixl-node/). */
  prefix?: string;
}

/** The key prefix, ending in '/'. */
export function fleetPrefix(o: EtcdOptions): string {
  const p = o.prefix ?? '/nixl-node/';
  if (p.length === 0 || p.length > 256) throw new RangeError('an etcd prefix is 1 to 256 characters');
  return p.endsWith('/') ? p : `${p}/`;
}

/** Checks endpoint URLs: http(s)://host:port, at least one. */
export function checkEndpoints(endpoints: readonly string[]): string[] {
  if (endpoints.length === 0) throw new RangeError('etcd needs at least one endpoint URL');
  const out = endpoints.map((e) => {
    let u: URL;
    try {
      u = new URL(e);
    } catch {
      throw new RangeError(`etcd endpoint must be a URL (http://host:2379), got '${e}'`);
    }
    if (u.protocol !== 'http:' && u.protocol !== 'https:')
      throw new RangeError(`etcd endpoint must be http:// or https://, got '${e}'`);
    return `${u.protocol}//${u.host}`;
  });
  if (new Set(out.map((e) => e.startsWith('https:'))).size > 1)
    throw new RangeError('etcd endpoints must be all http:// or all https://');
  return out;
}
