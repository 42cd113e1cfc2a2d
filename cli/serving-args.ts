// What the proxy and worker commands share: address and port options, etcd
// endpoints, EADDRINUSE as a usage error, and waiting for a signal.
import { UsageError } from './args';
import { checkEndpoints } from '../lib/serving/fleet/etcd';

export function list(v: Record<string, unknown>, name: string): string[] {
  const s = v[name];
  if (s === undefined) return [];
  const out = String(s)
    .split(',')
    .map((x) => x.trim())
    .filter(Boolean);
  if (out.length === 0) throw new UsageError(`--${name} is empty`);
  return out;
}

export function port(v: Record<string, unknown>, def: number): number {
  return v.port === undefined ? def : portNumber(String(v.port), 'port');
}

export function portNumber(s: string, name: string): number {
  if (!/^\d+$/.test(s) || Number(s) > 65535) throw new UsageError(`--${name} must be a port number, got '${s}'`);
  return Number(s);
}

export function integer(s: string, name: string): number {
  if (!/^-?\d{1,10}$/.test(s)) throw new UsageError(`--${name} must be an integer, got '${s}'`);
  return Number(s);
}

/** An address already taken: the error names it and the options that choose it. */
export function inUse(e: unknown, options: string): unknown {
  const err = e as Error & { code?: string; address?: string; port?: number };
  if (err?.code !== 'EADDRINUSE' && !/address already in use/i.test(err?.message ?? '')) return e;
  const what = err.address
    ? `${err.address}${err.port ? `:${err.port}` : ''} is already in use`
    : err.message.replace(/^listen EADDRINUSE: /, '');
  return new UsageError(
    `${what} (EADDRINUSE): another process listens there; choose another with ${options} (port 0: any free port)`,
  );
}

/** --etcd and --etcd-prefix, checked. */
export function etcdOptions(v: Record<string, unknown>): { endpoints: string[]; prefix?: string } | undefined {
  if (v.etcd === undefined) {
    if (v['etcd-prefix'] !== undefined) throw new UsageError('--etcd-prefix goes with --etcd');
    return undefined;
  }
  const endpoints = list(v, 'etcd');
  try {
    checkEndpoints(endpoints);
  } catch (e) {
    throw new UsageError(`--etcd: ${(e as Error).message}`);
  }
  const prefix = v['etcd-prefix'] as string | undefined;
  if (prefix !== undefined && (prefix.length === 0 || prefix.length > 256))
    throw new UsageError('--etcd-prefix must be 1 to 256 characters');
  return { endpoints, prefix };
}
