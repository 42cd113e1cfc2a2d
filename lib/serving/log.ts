// What the proxy and the workers log through: pino's calling convention
// (an object of fields, then the message), so a pino logger (or a child of
// one) is passed as it is. A library user who passes none gets silence: an
// embedded proxy or worker never writes to the application's stderr on its
// own. The nixl-node command passes pino, JSON lines on stderr.

/** A structured logger: pino's, or anything with its `(fields, message)` methods. */
export interface Logger {
  debug(fields: object, msg?: string): void;
  info(fields: object, msg?: string): void;
  warn(fields: object, msg?: string): void;
  error(fields: object, msg?: string): void;
}

const nothing = (): void => {};

/** The default: logs nothing. */
export const silentLogger: Logger = { debug: nothing, info: nothing, warn: nothing, error: nothing };
