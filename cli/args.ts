// Option parsing shared by the nixl-node commands: util.parseArgs (so --x=y
// works), --help everywhere, and a bad value is one line on stderr and exit
// code 2, never a stack trace. Command-line code: it may exit the process, so
// only cli/ uses it (demo/ and bench/ take parsed options).
import { writeSync } from 'node:fs';
import { parseArgs, type ParseArgsConfig } from 'node:util';
import { setUcxNetDevices } from '../lib/ucx';

export class UsageError extends Error {}

export type Options = NonNullable<ParseArgsConfig['options']>;

/** Parses argv; prints help and exits 0 on --help; throws UsageError on anything wrong. */
export function parse(argv: string[], options: Options, help: string): Record<string, string | boolean | undefined> {
  let values: Record<string, string | boolean | (string | boolean)[] | undefined>;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: { ...options, help: { type: 'boolean', short: 'h' } },
      strict: true,
    }));
  } catch (e) {
    throw new UsageError(`${(e as Error).message.split('\n')[0]} (try --help)`);
  }
  if (values.help) {
    process.stdout.write(help);
    process.exit(0);
  }
  return values as Record<string, string | boolean | undefined>;
}

/** A positive integer option, at most max. */
export function positiveInt(values: Record<string, unknown>, name: string, def: number, max = 1 << 30): number {
  const v = values[name];
  if (v === undefined) return def;
  const n = Number(v);
  if (!/^\d+$/.test(String(v)) || !Number.isSafeInteger(n) || n < 1 || n > max) {
    throw new UsageError(`--${name} must be an integer from 1 to ${max}, got '${String(v)}'`);
  }
  return n;
}

export function oneOf<T extends string>(
  values: Record<string, unknown>,
  name: string,
  allowed: readonly T[],
  def: T,
): T {
  const v = values[name];
  if (v === undefined) return def;
  if (!allowed.includes(v as T))
    throw new UsageError(`--${name} must be one of ${allowed.join(', ')}, got '${String(v)}'`);
  return v as T;
}

let failureLog: { fatal(fields: object, msg?: string): void } | undefined;

/** Where run() reports a command's failure (exit 1) once the command has a logger: a JSON line, not plain text. */
export function reportFailuresTo(log: { fatal(fields: object, msg?: string): void }): void {
  failureLog = log;
}

/** Runs a command's main: a UsageError (or a NixlError of bad input) is one line and exit 2. */
export function run(what: string, main: () => Promise<void>): void {
  main().catch((e: Error & { code?: string }) => {
    const usage =
      e instanceof UsageError || e?.code === 'NIXL_ERR_INVALID_PARAM' || e?.code === 'NIXL_ERR_NOT_SUPPORTED';
    const msg = usage
      ? `nixl-node ${what}: ${e.message}`
      : `nixl-node ${what} failed: ${e?.code ? `${e.code}: ` : ''}${e?.message ?? e}`;
    // A bad option or value is one plain line whichever check finds it (some come before the logger).
    if (failureLog && !usage) failureLog.fatal({ ...(e?.code ? { code: e.code } : {}), exit_code: 1 }, msg);
    // Straight to fd 2: process.stderr may be the logger's capture (cli/log.ts).
    else writeSync(2, `${msg}\n`);
    process.exit(usage ? 2 : 1);
  });
}

/** The --ucx-net-devices option of a command that starts agents: sets UCX_NET_DEVICES (lib/ucx.ts). */
export const UCX_NET_DEVICES_OPTION = { 'ucx-net-devices': { type: 'string' } } as const;
export const UCX_NET_DEVICES_HELP =
  '  --ucx-net-devices LIST  UCX_NET_DEVICES for NIXL agents, e.g. mlx5_0:1 (pin the NIC; see docs/nixl.md)\n';

export function applyUcxNetDevices(values: Record<string, unknown>): void {
  const v = values['ucx-net-devices'];
  if (v === undefined) return;
  try {
    setUcxNetDevices(String(v));
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
}

/** Resolves on the first SIGINT or SIGTERM (the handlers are in place when this returns). */
export function untilSignal(): Promise<void> {
  return new Promise((resolve) => {
    for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => resolve());
  });
}
