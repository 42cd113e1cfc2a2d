// vLLM's ZMQ side channel: a ROUTER per engine (port + dp_rank) answering
// msgpack [b"get_meta_msg", tp_rank] with that rank's NixlHandshakePayload;
// REQ clients with a timeout and retries.
import * as zmq from 'zeromq';
import {
  HandshakeError,
  type HandshakePayload,
  decodeHandshakePayload,
  decodeMetaRequest,
  encodeHandshakePayload,
  encodeMetaRequest,
  openHandshakePayload,
  packMsgpack,
} from './codec';
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

function errorFrame(message: string): Buffer {
  return packMsgpack(new Map([['error', message]]));
}

function endpointPort(ep: string | null): number {
  const m = /:(\d+)$/.exec(ep ?? '');
  if (!m) throw new HandshakeError(`cannot tell the bound port from '${ep}'`, 'NIXL_ERR_BACKEND');
  return Number(m[1]);
}

function tcp(host: string, port: number | '*'): string {
  return host.includes(':') ? `tcp://[${host}]:${port}` : `tcp://${host}:${port}`;
}

class ZmqServer implements HandshakeServer {
  readonly method = 'zmq' as const;
  readonly stats = { served: 0, refused: 0 };
  readonly #encoded = new Map<number, Buffer>();
  #closed = false;
  #loop: Promise<void> = Promise.resolve();

  private constructor(
    readonly host: string,
    readonly port: number,
    readonly basePort: number,
    readonly dpRank: number,
    private readonly sock: zmq.Router,
    private readonly opts: ServeOptions,
  ) {
    for (const [r, p] of opts.payloads) this.setPayload(r, p);
  }

  static async start(opts: ServeOptions): Promise<ZmqServer> {
    const host = opts.host ?? '127.0.0.1';
    const dp = checkRank('dpRank', opts.dpRank);
    const sock = new zmq.Router({
      linger: 0,
      maxMessageSize: opts.maxRequestBytes ?? DEFAULT_MAX_REQUEST,
      sendTimeout: 1000,
    });
    const want = opts.port === 0 ? '*' : opts.port + dp;
    try {
      await sock.bind(tcp(host, want));
    } catch (e) {
      sock.close();
      throw new HandshakeError(`cannot listen on ${tcp(host, want)}: ${(e as Error).message}`, 'NIXL_ERR_BACKEND', {
        cause: e,
      });
    }
    const port = endpointPort(sock.lastEndpoint);
    const s = new ZmqServer(host, port, opts.port === 0 ? port : opts.port, dp, sock, opts);
    s.#loop = s.#serve();
    return s;
  }

  setPayload(tpRank: number, payload: HandshakePayload): void {
    this.#encoded.set(checkRank('tpRank', tpRank), encodeHandshakePayload(payload));
  }

  async #serve(): Promise<void> {
    const log = this.opts.logger ?? defaultLogger;
    for (;;) {
      let frames: Buffer[];
      try {
        frames = await this.sock.receive();
      } catch (e) {
        if (this.#closed) return;
        log.warn(`receive failed: ${(e as Error).message}`);
        continue;
      }
      // REQ peers send [identity, '', msg]; DEALER peers [identity, msg].
      if (frames.length < 2 || frames.length > 3 || (frames.length === 3 && frames[1].length !== 0)) {
        this.stats.refused++;
        log.warn(`ignored a message of ${frames.length} frames`);
        if (frames.length >= 2)
          await this.#reply(frames[0], frames.length === 3, errorFrame('malformed request frames'));
        continue;
      }
      const withDelimiter = frames.length === 3;
      let answer: Buffer;
      try {
        const req = decodeMetaRequest(frames[frames.length - 1]);
        const rank = req.tpRank ?? this.opts.defaultTpRank ?? 0;
        const payload = this.#encoded.get(rank);
        if (!payload)
          throw new HandshakeError(
            `no metadata for tp_rank ${rank} (serving ranks ${[...this.#encoded.keys()].join(', ')})`,
          );
        answer = payload;
        this.stats.served++;
      } catch (e) {
        this.stats.refused++;
        log.warn(`refused a request: ${(e as Error).message}`);
        answer = errorFrame((e as Error).message);
      }
      await this.#reply(frames[0], withDelimiter, answer);
    }
  }

  async #reply(identity: Buffer, withDelimiter: boolean, body: Buffer): Promise<void> {
    try {
      await this.sock.send(withDelimiter ? [identity, Buffer.alloc(0), body] : [identity, body]);
    } catch (e) {
      if (!this.#closed) (this.opts.logger ?? defaultLogger).warn(`reply failed: ${(e as Error).message}`);
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.sock.close();
    await this.#loop;
  }
}

async function fetchOnce(opts: FetchOptions, timeoutMs: number): Promise<Buffer> {
  const sock = new zmq.Request({
    linger: 0,
    receiveTimeout: timeoutMs,
    sendTimeout: timeoutMs,
    immediate: true, // a send to nobody times out instead of queueing forever
    maxMessageSize: opts.maxResponseBytes ?? DEFAULT_MAX_RESPONSE,
  });
  const onAbort = () => sock.close();
  opts.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    sock.connect(tcp(opts.host, opts.port + checkRank('dpRank', opts.dpRank)));
    await sock.send(encodeMetaRequest(checkRank('tpRank', opts.tpRank)));
    const [reply] = await sock.receive();
    return reply;
  } finally {
    opts.signal?.removeEventListener('abort', onAbort);
    if (!sock.closed) sock.close();
  }
}

export const zmqHandshake: HandshakeStrategy = {
  method: 'zmq',
  serve: (opts) => ZmqServer.start(opts),
  async fetch(opts: FetchOptions): Promise<FetchResult> {
    const timeoutMs = opts.timeoutMs ?? defaultTimeoutMs();
    const attempts = 1 + (opts.retries ?? 2);
    const where = tcp(opts.host, opts.port + (opts.dpRank ?? 0));
    let last: unknown;
    for (let i = 0; i < attempts; i++) {
      if (opts.signal?.aborted)
        throw new HandshakeError(`handshake with ${where} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal.reason });
      const t0 = performance.now();
      let reply: Buffer;
      try {
        reply = await fetchOnce(opts, timeoutMs);
      } catch (e) {
        last = e;
        if (i + 1 < attempts) await new Promise((r) => setTimeout(r, Math.min(1000, 50 * 2 ** i)));
        continue;
      }
      const payload = decodeHandshakePayload(reply);
      return {
        compatibilityHash: payload.compatibilityHash,
        metadata: openHandshakePayload(payload, opts.expectedHash),
        rttMs: performance.now() - t0,
      };
    }
    if (opts.signal?.aborted)
      throw new HandshakeError(`handshake with ${where} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal.reason });
    throw new HandshakeError(
      `no answer from ${where} (tp_rank ${opts.tpRank}) after ${attempts} attempt(s) of ${timeoutMs} ms: ${(last as Error)?.message ?? 'timeout'}`,
      'NIXL_ERR_TIMEOUT',
      { cause: last },
    );
  },
  close() {},
};
