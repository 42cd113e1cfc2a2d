// The command's logger: pino, JSON lines on stderr (stdout keeps the ready
// and stopped lines scripts read), written synchronously so that the last
// lines before an exit are not lost. docs/serving.md promises JSON lines, so
// once a command has its logger, everything else that would reach stderr
// goes through it too: libraries' console.error (the etcd client's gRPC
// layer), Node's process warnings, and the command's own last error.
import { format } from 'node:util';
import pino from 'pino';
import type { Logger } from '../lib/serving/log';
import { oneOf, reportFailuresTo } from './args';

export const LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;

/** The --log-level option (default info, or NIXL_NODE_LOG_LEVEL). */
export function logLevel(v: Record<string, unknown>): (typeof LEVELS)[number] {
  const env = process.env.NIXL_NODE_LOG_LEVEL as (typeof LEVELS)[number] | undefined;
  return oneOf(v, 'log-level', LEVELS, env && LEVELS.includes(env) ? env : 'info');
}

export type CommandLogger = Logger & { level: string; fatal(fields: object, msg?: string): void };

/**
 * A pino logger for one command (`name`: proxy or worker): its lines carry
 * `name` (nixl-node-proxy / nixl-node-worker), so no log call may use that key
 * for anything else. Takes over the process's stderr (see above).
 */
export function commandLogger(name: string, level: string): CommandLogger {
  // pino writes to fd 2 itself (sonic-boom), not through process.stderr, so the capture below never loops.
  const log = pino(
    { name: `nixl-node-${name}`, level, timestamp: pino.stdTimeFunctions.isoTime },
    pino.destination({ fd: 2, sync: true }),
  );
  reportFailuresTo(log);
  captureStderr(log);
  return log;
}

/** Every write to process.stderr becomes a warn line (`source: 'stderr'`); process warnings keep their name and code. */
function captureStderr(log: CommandLogger): void {
  let partial = '';
  const write = (chunk: unknown, encoding?: unknown, cb?: unknown): boolean => {
    const text =
      typeof chunk === 'string'
        ? chunk
        : Buffer.from(chunk as Uint8Array).toString(
            typeof encoding === 'string' ? (encoding as BufferEncoding) : 'utf8',
          );
    const lines = (partial + text).split('\n');
    partial = lines.pop() ?? '';
    // A line longer than 64 KiB with no newline yet is logged as it is.
    if (partial.length > 65_536) {
      lines.push(partial);
      partial = '';
    }
    for (const l of lines) if (l.trim().length > 0) log.warn({ source: 'stderr' }, l.trimEnd());
    const done = typeof encoding === 'function' ? encoding : cb;
    if (typeof done === 'function') process.nextTick(done as () => void);
    return true;
  };
  process.stderr.write = write as typeof process.stderr.write;
  // Node prints warnings through its own listener; this one replaces it.
  process.removeAllListeners('warning');
  process.on('warning', (w: Error & { code?: string }) =>
    log.warn({ source: 'process', warning: w.name, ...(w.code ? { code: w.code } : {}) }, w.message),
  );
  // console.error and console.warn format as Node does, then go to the line above.
  for (const m of ['error', 'warn', 'trace'] as const)
    console[m] = (...a: unknown[]) => void process.stderr.write(`${format(...a)}\n`);
}
