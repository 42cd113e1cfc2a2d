// The limits both HTTP fronts (proxy and worker) put on their clients, in
// one place (docs/serving.md, "Limits of the HTTP fronts"):
// - headers must arrive within min(requestTimeout, 10 s) and the whole
//   request (headers and body) within requestTimeout (default 30 s), checked
//   every second: a client that sends a byte a second is cut with 408;
// - at most maxConnections open connections (default 4096): past it Node
//   closes a new connection at once, so a flood of connections cannot take
//   every descriptor of the process;
// - headers over Node's 16 KiB are 431, anything else unparsable 400.
// Bodies are bounded where they are read (readJson: 413, connection closed).
import * as http from 'node:http';

/** Open connections a front keeps at most, by default. */
export const DEFAULT_MAX_CONNECTIONS = 4096;

export interface HttpLimits {
  /** A request whose headers and body have not all arrived by then is cut (408). */
  requestTimeoutMs: number;
  /** Open connections at most (default 4096). */
  maxConnections?: number;
}

/** An HTTP server with the fronts' limits; `dropped` counts connections refused past maxConnections. */
export function createLimitedServer(
  limits: HttpLimits,
  handler: (req: http.IncomingMessage, res: http.ServerResponse) => void,
): http.Server & { dropped: number } {
  const server = http.createServer(
    {
      requestTimeout: limits.requestTimeoutMs,
      headersTimeout: Math.min(limits.requestTimeoutMs, 10_000),
      connectionsCheckingInterval: 1000,
    },
    handler,
  ) as http.Server & { dropped: number };
  server.maxConnections = limits.maxConnections ?? DEFAULT_MAX_CONNECTIONS;
  server.dropped = 0;
  server.on('drop', () => server.dropped++);
  server.on('clientError', (e: Error & { code?: string }, socket) => {
    const status =
      e.code === 'HPE_HEADER_OVERFLOW'
        ? '431 Request Header Fields Too Large'
        : e.code === 'ERR_HTTP_REQUEST_TIMEOUT'
          ? '408 Request Timeout'
          : '400 Bad Request';
    if (socket.writable && e.code !== 'ECONNRESET')
      socket.end(`HTTP/1.1 ${status}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n`);
    else socket.destroy();
  });
  return server;
}
