// Raw HTTP/1.1 connections for the attack tests (http-attack, llama-attack):
// what fetch cannot do, such as cutting a request or its answer at a byte.
import * as net from 'node:net';

/** A raw connection: what it received, and when it closed. `closers` gets its destroy. */
export function raw(url: string, closers: Array<() => unknown>) {
  const u = new URL(url);
  const s = net.connect(Number(u.port), u.hostname);
  const got: Buffer[] = [];
  const t0 = performance.now();
  const closed = new Promise<{ ms: number; text: string }>((resolve) => {
    s.on('close', () => resolve({ ms: performance.now() - t0, text: Buffer.concat(got).toString('latin1') }));
  });
  s.on('data', (d) => got.push(d));
  s.on('error', () => {});
  closers.push(() => s.destroy());
  return { s, closed, got, host: u.host };
}

/**
 * POSTs `body` to `route` and cuts the connection: after `sendBytes` of the
 * request (then 50 ms), at once after sending it (`cutAt` 0), once `cutAt`
 * bytes of the answer came, or after its last chunk ('end'); 'never' waits
 * up to 3 s for the server to close it.
 */
export function cut(
  closers: Array<() => unknown>,
  url: string,
  route: string,
  body: string,
  sendBytes: number | undefined,
  cutAt: number | 'end' | 'never',
) {
  const c = raw(url, closers);
  const req =
    `POST ${route} HTTP/1.1\r\nHost: ${c.host}\r\nContent-Type: application/json\r\n` +
    `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
  c.s.write(req.slice(0, sendBytes ?? req.length));
  if (cutAt === 0) c.s.destroy();
  let n = 0;
  c.s.on('data', (d) => {
    n += d.length;
    const text = Buffer.concat(c.got).toString('latin1');
    if ((cutAt === 'end' && text.endsWith('0\r\n\r\n')) || (typeof cutAt === 'number' && n >= cutAt)) c.s.destroy();
  });
  if (sendBytes !== undefined) setTimeout(() => c.s.destroy(), 50);
  if (cutAt === 'never') setTimeout(() => c.s.destroy(), 3000);
  return c.closed;
}

/** Where to cut an answer of `length` bytes: at once, and at `n` points spread over it. */
export function cutPoints(length: number, n: number): number[] {
  return [0, ...Array.from({ length: n }, (_, i) => Math.max(1, Math.floor(((i + 0.5) * length) / n)))];
}
