// The command's logger: pino, JSON lines on stderr (stdout keeps the ready
// and stopped lines scripts read), written synchronously so that the last
// lines before an exit are not lost.
import pino from 'pino';
import type { Logger } from '../lib/serving/log';
import { oneOf } from './args';

export const LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;

/** The --log-level option (default info, or NIXL_NODE_LOG_LEVEL). */
export function logLevel(v: Record<string, unknown>): (typeof LEVELS)[number] {
  const env = process.env.NIXL_NODE_LOG_LEVEL as (typeof LEVELS)[number] | undefined;
  return oneOf(v, 'log-level', LEVELS, env && LEVELS.includes(env) ? env : 'info');
}

/** A pino logger for one command (`name`: proxy or worker). */
export function commandLogger(name: string, level: string): Logger & { level: string } {
  return pino(
    { name: `nixl-node-${name}`, level, timestamp: pino.stdTimeFunctions.isoTime },
    pino.destination({ fd: 2, sync: true }),
  );
}
