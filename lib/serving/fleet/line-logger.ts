// A fleet's `log` option takes text lines (an application's own sink, or a
// test's); the worker and the proxy log fields and a message. This turns
// the one into the other: `<who>: <message> (key=value, ...)`.
import type { Logger } from '../log';

/** A Logger whose every call becomes one text line for `sink`. */
export function lineLogger(sink: (line: string) => void, who: string): Logger {
  const line = (fields: object, msg?: string) => {
    const kv = Object.entries(fields)
      .filter(([, v]) => v !== undefined)
      .map(([k, v]) => `${k}=${typeof v === 'string' && /^[\x20-\x7e]*$/.test(v) ? v : JSON.stringify(v)}`);
    sink(`${who}: ${msg ?? ''}${kv.length ? ` (${kv.join(', ')})` : ''}`);
  };
  return { debug: line, info: line, warn: line, error: line };
}
