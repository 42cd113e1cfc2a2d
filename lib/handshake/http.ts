// A dedicated HTTP/S side channel (never the user-facing API server); vLLM
// never merged one, so this is the reference. Schema: docs/side-channel-http.md
// (SCHEMA below), carrying either wire profile's metadata as JSON:
//   GET /get_kv_connector_metadata/{dp_rank}/{tp_rank}[?pp_rank=Q]  one rank
//   GET /get_kv_connector_metadata[/{dp_rank}]                       all ranks
// Addresses above 2^53 travel as decimal strings so JSON never rounds them.
import * as http from 'node:http';
import * as https from 'node:https';
import type { AddressInfo } from 'node:net';
import { HandshakeError } from './errors';
import { retryPause } from './retry-pause';
import type { HandshakePayload } from './payload';
import type { WireProfile } from './model';
import {
  agentMetadataFromJson,
  agentMetadataToJson,
  checkCompatibilityHash,
  decodeAgentMetadata,
  wireProfile,
} from './wire';
import {
  DEFAULT_MAX_REQUEST,
  fetchMaxResponseBytes,
  type FetchOptions,
  type FetchResult,
  type HandshakeServer,
  type HandshakeStrategy,
  type ServeOptions,
  checkRank,
  defaultLogger,
  fetchTimeoutMs,
  monotonicSeconds,
  payloadList,
  rankKey,
} from './types';

const PATH = '/get_kv_connector_metadata';
/** The JSON schema's name and version (docs/side-channel-http.md). */
export const HTTP_SCHEMA = 'nixl-node/side-channel/1';

interface RankEntry {
  ppRank: number;
  tpRank: number;
  compatibilityHash: string;
  agentMetadata: Record<string, unknown>;
}

class HttpServer implements HandshakeServer {
  readonly method = 'http' as const;
  readonly stats = { served: 0, refused: 0 };
  readonly #ranks = new Map<string, RankEntry>();
  readonly wire: WireProfile;
  readonly #clock: () => number;
  host = '';
  port = 0;
  basePort = 0;
  readonly dpRank: number;
  readonly #server: http.Server;

  constructor(private readonly opts: ServeOptions) {
    this.dpRank = checkRank('dpRank', opts.dpRank);
    this.wire = wireProfile(opts.wire);
    this.#clock = opts.clock ?? monotonicSeconds;
    for (const r of payloadList(opts.payloads)) this.setPayload(r.tpRank, r.payload, r.ppRank);
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

  setPayload(tpRank: number, p: HandshakePayload, ppRank = 0): void {
    const pp = checkRank('ppRank', ppRank);
    const tp = checkRank('tpRank', tpRank);
    if (pp !== 0 && this.wire.requestRanks.length === 1)
      throw new HandshakeError(`the ${this.wire.name} format has no pipeline ranks (pp_rank ${pp})`);
    this.#ranks.set(rankKey(pp, tp), {
      ppRank: pp,
      tpRank: tp,
      compatibilityHash: p.compatibilityHash,
      agentMetadata: agentMetadataToJson(decodeAgentMetadata(p.agentMetadataBytes, this.wire), this.wire),
    });
  }

  #entry(e: RankEntry): Record<string, unknown> {
    return {
      schema: HTTP_SCHEMA,
      wire: this.wire.name,
      nixl_connector_version: this.wire.connectorVersion,
      dp_rank: this.dpRank,
      pp_rank: e.ppRank,
      tp_rank: e.tpRank,
      server_time: this.wire.replyFrames === 2 ? this.#clock() : null,
      compatibility_hash: e.compatibilityHash,
      agent_metadata: e.agentMetadata,
    };
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
    const [url, query = ''] = (req.url ?? '').split('?', 2);
    if (url !== PATH && !url.startsWith(`${PATH}/`)) {
      send(404, { detail: `no route ${url.slice(0, 100)}; try ${PATH}[/{dp_rank}[/{tp_rank}]][?pp_rank=Q]` });
      return;
    }
    const parts = url.slice(PATH.length).split('/').filter(Boolean);
    if (parts.length > 2 || !parts.every((p) => /^\d{1,5}$/.test(p))) {
      send(404, { detail: 'ranks must be non-negative integers' });
      return;
    }
    const q = new URLSearchParams(query);
    const ppText = q.get('pp_rank') ?? '0';
    if (!/^\d{1,5}$/.test(ppText) || [...q.keys()].some((k) => k !== 'pp_rank')) {
      send(400, { detail: 'the only query parameter is pp_rank, a non-negative integer' });
      return;
    }
    const [dp, tp] = parts.map(Number);
    if (dp !== undefined && dp !== this.dpRank) {
      send(404, { detail: `dp_rank ${dp} is not served here (this side channel serves dp_rank ${this.dpRank})` });
      return;
    }
    if (tp === undefined) {
      send(200, {
        schema: HTTP_SCHEMA,
        wire: this.wire.name,
        nixl_connector_version: this.wire.connectorVersion,
        dp_rank: this.dpRank,
        ranks: [...this.#ranks.values()].map((e) => this.#entry(e)),
      });
      return;
    }
    const pp = Number(ppText);
    const entry = this.#ranks.get(rankKey(pp, tp));
    if (!entry) {
      send(404, {
        detail: `no metadata for (pp_rank ${pp}, tp_rank ${tp}) (serving ${[...this.#ranks.keys()].map((k) => `(${k})`).join(', ')})`,
      });
      return;
    }
    send(200, this.#entry(entry));
  }

  close(): Promise<void> {
    return new Promise((resolve) => {
      this.#server.close(() => resolve());
      this.#server.closeAllConnections();
    });
  }
}

/** The HTTP side channel (docs/side-channel-http.md), with TLS and client certificates optional. */
export class HttpHandshake implements HandshakeStrategy {
  readonly method = 'http' as const;
  readonly #httpAgent = new http.Agent({ keepAlive: true, maxSockets: 16 });
  readonly #httpsAgents = new Map<string, https.Agent>();

  /** keepAlive: false opens a new connection per request (for comparison). */
  constructor(private readonly keepAlive = true) {}

  /** Serves the handshake payloads of this engine's ranks. */
  async serve(opts: ServeOptions): Promise<HandshakeServer> {
    return new HttpServer(opts).listen();
  }

  /** Fetches one rank's payload from a remote side channel, with retries. */
  async fetch(opts: FetchOptions): Promise<FetchResult> {
    const timeoutMs = fetchTimeoutMs(opts.timeoutMs);
    const maxBytes = fetchMaxResponseBytes(opts.maxResponseBytes);
    const attempts = 1 + (opts.retries ?? 2);
    const wire = wireProfile(opts.wire);
    const pp = checkRank('ppRank', opts.ppRank);
    const url =
      `${opts.tls ? 'https' : 'http'}://${opts.host.includes(':') ? `[${opts.host}]` : opts.host}:${opts.port}` +
      `${PATH}/${checkRank('dpRank', opts.dpRank)}/${checkRank('tpRank', opts.tpRank)}${pp ? `?pp_rank=${pp}` : ''}`;
    let last: unknown;
    for (let i = 0; i < attempts; i++) {
      const t0 = monotonicSeconds();
      try {
        const body = await this.#get(url, opts, timeoutMs, maxBytes);
        const t1 = monotonicSeconds();
        const entry = body as Record<string, unknown>;
        if (typeof entry !== 'object' || entry === null || entry.schema !== HTTP_SCHEMA)
          throw new HandshakeError(
            `${url}: answer is not schema ${HTTP_SCHEMA} (got ${JSON.stringify(entry?.schema ?? null)})`,
            'NIXL_ERR_MISMATCH',
          );
        if (entry.wire !== wire.name)
          throw new HandshakeError(
            `${url}: the side channel speaks ${String(entry.wire)}, this client ${wire.name}: set the wire profile to ${String(entry.wire)}`,
            'NIXL_ERR_MISMATCH',
          );
        if (typeof entry.compatibility_hash !== 'string')
          throw new HandshakeError(`${url}: answer has no compatibility_hash`);
        checkCompatibilityHash(entry.compatibility_hash, opts.expectedHash);
        const remoteSeconds = typeof entry.server_time === 'number' ? entry.server_time : undefined;
        return {
          compatibilityHash: entry.compatibility_hash,
          metadata: agentMetadataFromJson(entry.agent_metadata, wire),
          rttMs: (t1 - t0) * 1000,
          wire: wire.name,
          remoteSeconds,
          clockOffsetS: remoteSeconds === undefined ? undefined : remoteSeconds - (t0 + t1) / 2,
        };
      } catch (e) {
        // A clear answer (404, mismatch, bad body, auth) is final; transport trouble is retried.
        if (e instanceof HandshakeError && e.code !== 'NIXL_ERR_TIMEOUT' && e.code !== 'NIXL_ERR_REMOTE_DISCONNECT')
          throw e;
        last = e;
        if (opts.signal?.aborted) break;
        if (i + 1 < attempts) await retryPause(i, opts.signal);
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

  #get(url: string, opts: FetchOptions, timeoutMs: number, max: number): Promise<unknown> {
    const mod = opts.tls ? https : http;
    return new Promise((resolve, reject) => {
      // A plain timer and listener, not AbortSignal.timeout() under AbortSignal.any():
      // Node 20 garbage-collects a timeout signal that only a composite signal refers
      // to, timer and all, and a peer that never answers then holds the fetch for good.
      // The first failure settles; destroy() then gets no error of its own: a kept-alive
      // socket whose answer has fully arrived is already detached from the request, and
      // an error given to destroy() (a signal's too) is emitted there with no listener.
      // The timer starts once the request exists: request() throws for options Node
      // refuses (a header with a newline), and a timer already running would then
      // reach a request that was never made.
      let req: http.ClientRequest;
      let timer: NodeJS.Timeout | undefined;
      const stop = (e: HandshakeError) => {
        fail(e);
        req.destroy();
      };
      const onAbort = () =>
        stop(new HandshakeError(`handshake with ${url} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal?.reason }));
      const done = () => {
        clearTimeout(timer);
        opts.signal?.removeEventListener('abort', onAbort);
      };
      const fail = (e: unknown) => {
        done();
        reject(e);
      };
      try {
        req = mod.request(
          url,
          {
            method: 'GET',
            agent: this.#agentFor(opts),
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
                stop(new HandshakeError(`${url}: answer larger than ${max} bytes`));
                return;
              }
              chunks.push(c);
            });
            res.on('error', (e) =>
              fail(new HandshakeError(`${url}: ${e.message}`, 'NIXL_ERR_REMOTE_DISCONNECT', { cause: e })),
            );
            res.on('end', () => {
              done();
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
      } catch (e) {
        // Not the peer's doing, and the same on every attempt: final, never retried.
        return reject(new HandshakeError(`${url}: ${(e as Error).message}`, 'NIXL_ERR_INVALID_PARAM', { cause: e }));
      }
      timer = setTimeout(
        () => stop(new HandshakeError(`${url}: no answer within ${timeoutMs} ms`, 'NIXL_ERR_TIMEOUT')),
        timeoutMs,
      );
      req.on('error', (e) =>
        fail(new HandshakeError(`${url}: ${e.message}`, 'NIXL_ERR_REMOTE_DISCONNECT', { cause: e })),
      );
      if (opts.signal?.aborted) onAbort();
      else opts.signal?.addEventListener('abort', onAbort, { once: true });
      req.end();
    });
  }

  close(): void {
    this.#httpAgent.destroy();
    for (const a of this.#httpsAgents.values()) a.destroy();
    this.#httpsAgents.clear();
  }
}
