// Handshake latency per method, against the raw transport measured in the
// same run: a REQ/ROUTER round trip (new REQ socket each time, as a
// handshake makes) and a plain HTTP(S) GET of a same-size body.
import * as http from 'node:http';
import * as https from 'node:https';
import type { AddressInfo } from 'node:net';
import * as zmq from 'zeromq';
import {
  HttpHandshake,
  encodeAgentMetadata,
  zmqHandshake,
  type HandshakePayload,
  type TlsServerOptions,
} from '../lib/handshake';
import { encodeHandshakePayload } from '../lib/handshake/payload';
import { median, percentile } from './stats';

export interface HandshakeRow {
  method: string;
  medianMs: number;
  p99Ms: number;
  rawMedianMs: number;
  rawP99Ms: number;
  ratio: number;
}

function payload(): HandshakePayload {
  // A realistic rank: 64 regions (32 layers x K/V), ~4 KB of agent metadata.
  const meta = {
    engineId: 'bench-prefill',
    agentMetadata: Buffer.alloc(4096, 7),
    kvCachesBaseAddr: Array.from({ length: 64 }, (_, i) => 0x7f0000000000n + BigInt(i) * 0x10000000n),
    deviceId: 0,
    numBlocks: 4096,
    blockLens: Array(64).fill(65536),
    kvCacheLayout: 'HND' as const,
    blockSize: 16,
    // Required by v12 (the default wire); v0.13 does not carry it.
    attnBackendName: 'FLASH_ATTN',
  };
  return { compatibilityHash: 'e'.repeat(64), agentMetadataBytes: encodeAgentMetadata(meta) };
}

async function time(n: number, f: () => Promise<unknown>): Promise<number[]> {
  for (let i = 0; i < 10; i++) await f(); // warm
  const xs: number[] = [];
  for (let i = 0; i < n; i++) {
    const t = performance.now();
    await f();
    xs.push(performance.now() - t);
  }
  return xs;
}

async function rawZmq(body: Buffer, n: number): Promise<number[]> {
  const router = new zmq.Router({ linger: 0 });
  await router.bind('tcp://127.0.0.1:*');
  const ep = router.lastEndpoint!;
  let running = true;
  void (async () => {
    for await (const [id, ,] of router) {
      if (!running) break;
      await router.send([id, Buffer.alloc(0), body]);
    }
  })().catch(() => {});
  const xs = await time(n, async () => {
    const req = new zmq.Request({ linger: 0 });
    req.connect(ep);
    await req.send('x');
    await req.receive();
    req.close();
  });
  running = false;
  router.close();
  return xs;
}

async function rawHttp(
  body: string,
  n: number,
  keepAlive: boolean,
  tls?: TlsServerOptions & { ca: Buffer },
): Promise<number[]> {
  const handler = (_q: http.IncomingMessage, s: http.ServerResponse) => {
    s.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
    s.end(body);
  };
  const server = tls ? https.createServer({ cert: tls.cert, key: tls.key }, handler) : http.createServer(handler);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  const port = (server.address() as AddressInfo).port;
  const agent = keepAlive
    ? tls
      ? new https.Agent({ keepAlive: true, ca: tls.ca })
      : new http.Agent({ keepAlive: true })
    : false;
  const xs = await time(
    n,
    () =>
      new Promise<void>((resolve, reject) => {
        const req = (tls ? https : http).request({ host: '127.0.0.1', port, path: '/', agent, ca: tls?.ca }, (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (c) => chunks.push(c));
          res.on('end', () => {
            JSON.parse(Buffer.concat(chunks).toString());
            resolve();
          });
        });
        req.on('error', reject);
        req.end();
      }),
  );
  if (agent) agent.destroy();
  server.closeAllConnections();
  await new Promise((r) => server.close(r));
  return xs;
}

export async function benchHandshake(
  n: number,
  tls?: { cert: Buffer; key: Buffer; ca: Buffer },
): Promise<HandshakeRow[]> {
  const p = payload();
  const quiet = { warn() {} };
  const rows: HandshakeRow[] = [];
  const row = (method: string, ours: number[], raw: number[]) =>
    rows.push({
      method,
      medianMs: median(ours),
      p99Ms: percentile(ours, 99),
      rawMedianMs: median(raw),
      rawP99Ms: percentile(raw, 99),
      ratio: median(ours) / median(raw),
    });

  const zs = await zmqHandshake.serve({ port: 0, payloads: new Map([[0, p]]), logger: quiet });
  const ours = await time(n, () =>
    zmqHandshake.fetch({ host: '127.0.0.1', port: zs.basePort, tpRank: 0, expectedHash: p.compatibilityHash }),
  );
  await zs.close();
  row('zmq (new REQ socket)', ours, await rawZmq(encodeHandshakePayload(p), n));

  for (const secure of [false, true]) {
    if (secure && !tls) continue;
    for (const keepAlive of [true, false]) {
      const h = new HttpHandshake(keepAlive);
      const s = await h.serve({
        port: 0,
        payloads: new Map([[0, p]]),
        logger: quiet,
        tls: secure ? { cert: tls!.cert, key: tls!.key } : undefined,
      });
      const t = await time(n, () =>
        h.fetch({
          host: '127.0.0.1',
          port: s.port,
          tpRank: 0,
          expectedHash: p.compatibilityHash,
          tls: secure ? { ca: tls!.ca } : undefined,
        }),
      );
      // the same JSON body the side channel sends, served raw
      const raw = await rawHttp(
        JSON.stringify({
          compatibility_hash: p.compatibilityHash,
          agent_metadata: {
            agent_metadata: Buffer.alloc(4096, 7).toString('base64'),
            kv_caches_base_addr: Array(64).fill(139637976727552),
          },
        }),
        n,
        keepAlive,
        secure ? { cert: tls!.cert, key: tls!.key, ca: tls!.ca } : undefined,
      );
      h.close();
      await s.close();
      row(`${secure ? 'https' : 'http'} (${keepAlive ? 'keep-alive' : 'new connection'})`, t, raw);
    }
  }
  return rows;
}
