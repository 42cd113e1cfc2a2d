// What the proxy and the workers log through: pino's calling convention
// (an object of fields, then the message), so a pino logger (or a child of
// one) is passed as it is. A library user who passes none gets silence: an
// embedded proxy or worker never writes to the application's stderr on its
// own. The nixl-node command passes pino, JSON lines on stderr.

/** A structured logger: pino's, or anything with its `(fields, message)` methods. */
export interface Logger {
  /** Detail for diagnosis: a worker's line per served request. */
  debug(fields: object, msg?: string): void;
  /** What an operator follows: the proxy's line per request, refusals, a worker that comes back. */
  info(fields: object, msg?: string): void;
  /** Something degraded: a failed request, a worker unhealthy or ejected. */
  warn(fields: object, msg?: string): void;
  /** A fleet that cannot serve as configured: prefill and decode of different models. */
  error(fields: object, msg?: string): void;
}

const nothing = (): void => {};

/** The default: logs nothing. */
export const silentLogger: Logger = { debug: nothing, info: nothing, warn: nothing, error: nothing };
