// A dedicated HTTP/S side channel (never the user-facing API server):
//   GET /get_kv_connector_metadata[/{dp_rank}[/{tp_rank}]]
// answers JSON; each rank entry is
//   { compatibility_hash, agent_metadata: { engine_id, agent_metadata: <base64>,
//     kv_caches_base_addr: [int | decimal string], device_id, num_blocks,
//     block_lens, kv_cache_layout, block_size } }
// Addresses above 2^53 travel as decimal strings so JSON never rounds them.
import * as http from 'node:http';
import * as https from 'node:https';
import type { AddressInfo } from 'node:net';
import { HandshakeError, type HandshakePayload, type NixlAgentMetadata, decodeAgentMetadata } from './codec';
import {
  DEFAULT_MAX_REQUEST,
  DEFAULT_MAX_RESPONSE,
  type FetchOptions,
  type FetchResult,
  type HandshakeServer,
  type HandshakeStrategy,
  type ServeOptions,
  checkRank,
  defaultLogger,
  defaultTimeoutMs,
} from './types';

const PATH = '/get_kv_connector_metadata';

function metadataToJson(m: NixlAgentMetadata): Record<string, unknown> {
  return {
    engine_id: m.engineId,
    agent_metadata: m.agentMetadata.toString('base64'),
    kv_caches_base_addr: m.kvCachesBaseAddr.map((a) =>
      a <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(a) : a.toString(),
    ),
    device_id: m.deviceId,
    num_blocks: m.numBlocks,
    block_lens: m.blockLens,
    kv_cache_layout: m.kvCacheLayout,
    block_size: m.blockSize,
  };
}

function jsonToMetadata(o: unknown): NixlAgentMetadata {
  const bad = (what: string): never => {
    throw new HandshakeError(`side channel answer: ${what}`);
  };
  if (typeof o !== 'object' || o === null) bad('agent_metadata must be an object');
  const r = o as Record<string, unknown>;
  const uint = (v: unknown, k: string): number =>
    Number.isSafeInteger(v) && (v as number) >= 0 ? (v as number) : bad(`${k} must be an unsigned integer`);
  const addr = (v: unknown): bigint => {
    if (typeof v === 'number' && Number.isSafeInteger(v) && v >= 0) return BigInt(v);
    if (typeof v === 'string' && /^\d{1,20}$/.test(v) && BigInt(v) < 1n << 64n) return BigInt(v);
    return bad('kv_caches_base_addr entries must be unsigned integers');
  };
  if (typeof r.engine_id !== 'string') bad('engine_id must be a string');
  if (typeof r.agent_metadata !== 'string' || !/^[A-Za-z0-9+/]*={0,2}$/.test(r.agent_metadata))
    bad('agent_metadata must be base64');
  if (!Array.isArray(r.kv_caches_base_addr)) bad('kv_caches_base_addr must be a list');
  if (!Array.isArray(r.block_lens)) bad('block_lens must be a list');
  if (r.kv_cache_layout !== 'HND' && r.kv_cache_layout !== 'NHD') bad("kv_cache_layout must be 'HND' or 'NHD'");
  return {
    engineId: r.engine_id as string,
    agentMetadata: Buffer.from(r.agent_metadata as string, 'base64'),
    kvCachesBaseAddr: (r.kv_caches_base_addr as unknown[]).map(addr),
    deviceId: uint(r.device_id, 'device_id'),
    numBlocks: uint(r.num_blocks, 'num_blocks'),
    blockLens: (r.block_lens as unknown[]).map((v) => uint(v, 'block_lens')),
    kvCacheLayout: r.kv_cache_layout as 'HND' | 'NHD',
    blockSize: uint(r.block_size, 'block_size'),
  };
}

class HttpServer implements HandshakeServer {
  readonly method = 'http' as const;
  readonly stats = { served: 0, refused: 0 };
  readonly #ranks = new Map<number, Record<string, unknown>>();
  host = '';
  port = 0;
  basePort = 0;
  readonly dpRank: number;
  readonly #server: http.Server;

  constructor(private readonly opts: ServeOptions) {
    this.dpRank = checkRank('dpRank', opts.dpRank);
    for (const [r, p] of opts.payloads) this.setPayload(r, p);
    const common: http.ServerOptions = {
      maxHeaderSize: Math.max(1024, opts.maxRequestBytes ?? DEFAULT_MAX_REQUEST),
      requestTimeout: 10_000,
      headersTimeout: 5_000,
      keepAliveTimeout: 30_000,
    };
    const handler = (req: http.IncomingMessage, res: http.ServerResponse) => this.#handle(req, res);
    this.#server = opts.tls
      ? https.createServer(
          {
            ...common,
            cert: opts.tls.cert,
            key: opts.tls.key,
            ca: opts.tls.clientCa,
            requestCert: opts.tls.clientCa !== undefined,
            rejectUnauthorized: opts.tls.clientCa !== undefined,
          },
          handler,
        )
      : http.createServer(common, handler);
    // Garbage on the socket: answer 400 if we still can, never throw.
    this.#server.on('clientError', (err, socket) => {
      this.stats.refused++;
      (opts.logger ?? defaultLogger).warn(`bad request: ${err.message}`);
      if (socket.writable) socket.end('HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n');
      else socket.destroy();
    });
    this.#server.on('tlsClientError', (err) => {
      this.stats.refused++;
      (opts.logger ?? defaultLogger).warn(`TLS client refused: ${err.message}`);
    });
  }

  async listen(): Promise<this> {
    const host = this.opts.host ?? '127.0.0.1';
    await new Promise<void>((resolve, reject) => {
      this.#server.once('error', (e) =>
        reject(
          new HandshakeError(`cannot listen on ${host}:${this.opts.port}: ${e.message}`, 'NIXL_ERR_BACKEND', {
            cause: e,
          }),
        ),
      );
      this.#server.listen(this.opts.port, host, () => resolve());
    });
    const a = this.#server.address() as AddressInfo;
    this.host = host;
    this.port = a.port;
    this.basePort = a.port;
    return this;
  }

  setPayload(tpRank: number, p: HandshakePayload): void {
    this.#ranks.set(checkRank('tpRank', tpRank), {
      compatibility_hash: p.compatibilityHash,
      agent_metadata: metadataToJson(decodeAgentMetadata(p.agentMetadataBytes)),
    });
  }

  #handle(req: http.IncomingMessage, res: http.ServerResponse): void {
    const send = (status: number, body: unknown, extra: Record<string, string> = {}) => {
      if (status >= 400) this.stats.refused++;
      else this.stats.served++;
      const text = JSON.stringify(body);
      res.writeHead(status, {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(text),
        ...extra,
      });
      res.end(text);
    };
    if (this.opts.bearerToken !== undefined && req.headers.authorization !== `Bearer ${this.opts.bearerToken}`) {
      send(401, { detail: 'missing or wrong bearer token' }, { 'www-authenticate': 'Bearer' });
      return;
    }
    if (req.method !== 'GET') {
      send(405, { detail: 'only GET is served' }, { allow: 'GET' });
      return;
    }
    const len = Number(req.headers['content-length'] ?? 0);
    if (len > 0 || req.headers['transfer-encoding']) {
      send(413, { detail: 'requests carry no body' }, { connection: 'close' });
      return;
    }
    const url = (req.url ?? '').split('?')[0];
    if (url !== PATH && !url.startsWith(`${PATH}/`)) {
      send(404, { detail: `no route ${url.slice(0, 100)}; try ${PATH}[/{dp_rank}[/{tp_rank}]]` });
      return;
    }
    const parts = url.slice(PATH.length).split('/').filter(Boolean);
    if (parts.length > 2 || !parts.every((p) => /^\d{1,5}$/.test(p))) {
      send(404, { detail: 'ranks must be non-negative integers' });
      return;
    }
    const [dp, tp] = parts.map(Number);
    const all = Object.fromEntries([...this.#ranks].map(([r, v]) => [String(r), v]));
    if (dp === undefined) {
      send(200, { [String(this.dpRank)]: all });
      return;
    }
    if (dp !== this.dpRank) {
      send(404, { detail: `dp_rank ${dp} is not served here (this side channel serves dp_rank ${this.dpRank})` });
      return;
    }
    if (tp === undefined) {
      send(200, all);
      return;
    }
    const entry = this.#ranks.get(tp);
    if (!entry) {
      send(404, { detail: `no metadata for tp_rank ${tp} (serving ranks ${[...this.#ranks.keys()].join(', ')})` });
      return;
    }
    send(200, entry);
    return;
  }

  close(): Promise<void> {
    return new Promise((resolve) => {
      this.#server.close(() => resolve());
      this.#server.closeAllConnections();
    });
  }
}

export class HttpHandshake implements HandshakeStrategy {
  readonly method = 'http' as const;
  readonly #httpAgent = new http.Agent({ keepAlive: true, maxSockets: 16 });
  readonly #httpsAgents = new Map<string, https.Agent>();

  /** keepAlive: false opens a new connection per request (for comparison). */
  constructor(private readonly keepAlive = true) {}

  async serve(opts: ServeOptions): Promise<HandshakeServer> {
    return new HttpServer(opts).listen();
  }

  async fetch(opts: FetchOptions): Promise<FetchResult> {
    const timeoutMs = opts.timeoutMs ?? defaultTimeoutMs();
    const attempts = 1 + (opts.retries ?? 2);
    const url =
      `${opts.tls ? 'https' : 'http'}://${opts.host.includes(':') ? `[${opts.host}]` : opts.host}:${opts.port}` +
      `${PATH}/${checkRank('dpRank', opts.dpRank)}/${checkRank('tpRank', opts.tpRank)}`;
    let last: unknown;
    for (let i = 0; i < attempts; i++) {
      const t0 = performance.now();
      try {
        const body = await this.#get(url, opts, timeoutMs);
        const rttMs = performance.now() - t0;
        const entry = body as { compatibility_hash?: unknown; agent_metadata?: unknown };
        if (typeof entry !== 'object' || entry === null || typeof entry.compatibility_hash !== 'string') {
          throw new HandshakeError(`${url}: answer has no compatibility_hash`);
        }
        if (opts.expectedHash !== undefined && entry.compatibility_hash !== opts.expectedHash) {
          throw new HandshakeError(
            `compatibility hash mismatch: remote ${entry.compatibility_hash}, local ${opts.expectedHash}`,
            'NIXL_ERR_MISMATCH',
          );
        }
        return { compatibilityHash: entry.compatibility_hash, metadata: jsonToMetadata(entry.agent_metadata), rttMs };
      } catch (e) {
        // A clear answer (404, mismatch, bad body, auth) is final; transport trouble is retried.
        if (e instanceof HandshakeError && e.code !== 'NIXL_ERR_TIMEOUT' && e.code !== 'NIXL_ERR_REMOTE_DISCONNECT')
          throw e;
        last = e;
        if (opts.signal?.aborted) break;
        if (i + 1 < attempts) await new Promise((r) => setTimeout(r, Math.min(1000, 50 * 2 ** i)));
      }
    }
    if (opts.signal?.aborted)
      throw new HandshakeError(`handshake with ${url} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal.reason });
    throw new HandshakeError(
      `no answer from ${url} after ${attempts} attempt(s): ${(last as Error)?.message}`,
      'NIXL_ERR_TIMEOUT',
      { cause: last },
    );
  }

  #agentFor(opts: FetchOptions): http.Agent | https.Agent | false {
    if (!this.keepAlive) return false;
    if (!opts.tls) return this.#httpAgent;
    const key = JSON.stringify([opts.tls.ca?.toString(), opts.tls.cert?.toString(), opts.tls.servername]);
    let a = this.#httpsAgents.get(key);
    if (!a) {
      a = new https.Agent({
        keepAlive: true,
        maxSockets: 16,
        ca: opts.tls.ca,
        cert: opts.tls.cert,
        key: opts.tls.key,
        servername: opts.tls.servername,
      });
      this.#httpsAgents.set(key, a);
    }
    return a;
  }

  #get(url: string, opts: FetchOptions, timeoutMs: number): Promise<unknown> {
    const max = opts.maxResponseBytes ?? DEFAULT_MAX_RESPONSE;
    const mod = opts.tls ? https : http;
    return new Promise((resolve, reject) => {
      const signals = [AbortSignal.timeout(timeoutMs), ...(opts.signal ? [opts.signal] : [])];
      const req = mod.request(
        url,
        {
          method: 'GET',
          agent: this.#agentFor(opts),
          signal: AbortSignal.any(signals),
          headers: opts.bearerToken ? { authorization: `Bearer ${opts.bearerToken}` } : {},
          ...(opts.tls && !this.keepAlive
            ? { ca: opts.tls.ca, cert: opts.tls.cert, key: opts.tls.key, servername: opts.tls.servername }
            : {}),
        },
        (res) => {
          const chunks: Buffer[] = [];
          let size = 0;
          res.on('data', (c: Buffer) => {
            size += c.length;
            if (size > max) {
              req.destroy(new HandshakeError(`${url}: answer larger than ${max} bytes`));
              return;
            }
            chunks.push(c);
          });
          res.on('error', (e) => reject(e));
          res.on('end', () => {
            const text = Buffer.concat(chunks).toString('utf8');
            let body: unknown;
            try {
              body = JSON.parse(text);
            } catch {
              return reject(new HandshakeError(`${url}: HTTP ${res.statusCode}, not JSON`));
            }
            if (res.statusCode !== 200) {
              const detail = (body as { detail?: unknown })?.detail;
              return reject(
                new HandshakeError(
                  `${url}: HTTP ${res.statusCode}: ${typeof detail === 'string' ? detail : text.slice(0, 200)}`,
                  'NIXL_ERR_NOT_FOUND',
                ),
              );
            }
            resolve(body);
          });
        },
      );
      req.on('error', (e) => {
        if (e instanceof HandshakeError) return reject(e);
        const timedOut = e.name === 'AbortError' || e.name === 'TimeoutError';
        reject(
          new HandshakeError(
            `${url}: ${timedOut ? `no answer within ${timeoutMs} ms` : e.message}`,
            timedOut ? 'NIXL_ERR_TIMEOUT' : 'NIXL_ERR_REMOTE_DISCONNECT',
            { cause: e },
          ),
        );
      });
      req.end();
    });
  }

  close(): void {
    this.#httpAgent.destroy();
    for (const a of this.#httpsAgents.values()) a.destroy();
    this.#httpsAgents.clear();
  }
}
