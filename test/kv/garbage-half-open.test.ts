// A client that sends garbage and then never closes its side: each HTTP
// server answers 400 and ends its side, and must not keep the socket open for
// as long as that client likes (it held the server's close() forever, and
// one socket of the process's descriptors per such client).
import * as net from 'node:net';
import { expect, it } from 'vitest';
import { HttpHandshake } from '../../lib/handshake/http';
import { createLimitedServer } from '../../lib/serving/api/http-server';
import type { HandshakePayload } from '../../lib/handshake/model';

/** Sends `junk` from a client that keeps its side open; resolves with what it read once the server ended. */
function halfOpenClient(port: number, junk: string): Promise<{ answer: string; socket: net.Socket }> {
  return new Promise((resolve, reject) => {
    const c = net.connect({ port, host: '127.0.0.1', allowHalfOpen: true }, () => c.write(junk));
    let answer = '';
    c.on('data', (d) => (answer += d));
    c.on('end', () => resolve({ answer, socket: c })); // the server ended; this side stays open
    c.on('error', reject);
  });
}

/** Whether `p` settles within `ms`. */
async function within(p: Promise<unknown>, ms: number): Promise<boolean> {
  let t: NodeJS.Timeout | undefined;
  const late = new Promise<false>((r) => {
    t = setTimeout(() => r(false), ms);
  });
  try {
    return await Promise.race([p.then(() => true), late]);
  } finally {
    clearTimeout(t);
  }
}

const JUNK = ['\x00\x01\x02garbage\r\n\r\n', `GET /${'x'.repeat(20000)} HTTP/1.1\r\n\r\n`];

it("the side channel's HTTP server answers garbage with 400 and closes despite a client that stays half-open", async () => {
  const h = new HttpHandshake();
  const s = await h.serve({ port: 0, payloads: new Map<number, HandshakePayload>(), logger: { warn() {} } as never });
  const clients: net.Socket[] = [];
  try {
    for (const junk of JUNK) {
      const { answer, socket } = await halfOpenClient(s.port, junk);
      clients.push(socket);
      expect(answer).toMatch(/^HTTP\/1.1 4\d\d/);
    }
    expect(await within(s.close(), 8000)).toBe(true);
  } finally {
    for (const c of clients) c.destroy();
    h.close();
  }
}, 20_000);

it("the fronts' HTTP server answers garbage with 4xx and closes despite a client that stays half-open", async () => {
  const server = createLimitedServer({ requestTimeoutMs: 30_000 }, (_req, res) => res.end('ok'));
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  const port = (server.address() as net.AddressInfo).port;
  const clients: net.Socket[] = [];
  try {
    for (const junk of JUNK) {
      const { answer, socket } = await halfOpenClient(port, junk);
      clients.push(socket);
      expect(answer).toMatch(/^HTTP\/1.1 4\d\d/);
    }
    const closed = new Promise<void>((r) => server.close(() => r()));
    server.closeAllConnections();
    expect(await within(closed, 8000)).toBe(true);
  } finally {
    for (const c of clients) c.destroy();
  }
}, 20_000);
