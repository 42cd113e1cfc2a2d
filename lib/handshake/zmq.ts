// vLLM's ZMQ side channel: a ROUTER per engine (port + dp_rank) answering
// each (pp_rank, tp_rank) request with that rank's NixlHandshakePayload, in
// the frames of the wire profile; REQ clients with a timeout and retries.
// Unlike vLLM's listener, ours answers garbage with an error and stays up.
import * as zmq from 'zeromq';
import { HandshakeError } from './errors';
import { retryPause } from './retry-pause';
import { type HandshakePayload, decodeHandshakePayload, encodeHandshakePayload } from './payload';
import type { WireProfile } from './model';
import {
  decodeMetaRequest,
  encodeMetaRequest,
  errorFrames,
  openHandshakePayload,
  readReply,
  replyFrames,
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
  readonly #encoded = new Map<string, Buffer>();
  readonly wire: WireProfile;
  readonly #clock: () => number;
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
    this.wire = wireProfile(opts.wire);
    this.#clock = opts.clock ?? monotonicSeconds;
    for (const r of payloadList(opts.payloads)) this.setPayload(r.tpRank, r.payload, r.ppRank);
  }

  static async start(opts: ServeOptions): Promise<ZmqServer> {
    const host = opts.host ?? '127.0.0.1';
    const dp = checkRank('dpRank', opts.dpRank);
    wireProfile(opts.wire); // a bad profile name fails before binding
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

  setPayload(tpRank: number, payload: HandshakePayload, ppRank = 0): void {
    if (ppRank !== 0 && this.wire.requestRanks.length === 1)
      throw new HandshakeError(`the ${this.wire.name} format has no pipeline ranks (pp_rank ${ppRank})`);
    this.#encoded.set(
      rankKey(checkRank('ppRank', ppRank), checkRank('tpRank', tpRank)),
      encodeHandshakePayload(payload),
    );
  }

  #ranks(): string {
    return [...this.#encoded.keys()]
      .map((k) => (this.wire.requestRanks.length === 1 ? k.split(':')[1] : `(${k})`))
      .join(', ');
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
          await this.#reply(
            frames[0],
            frames.length === 3,
            errorFrames('malformed request frames', 'NIXL_ERR_INVALID_PARAM', this.wire, this.#clock()),
          );
        continue;
      }
      const withDelimiter = frames.length === 3;
      let answer: Buffer[];
      try {
        const req = decodeMetaRequest(frames[frames.length - 1], this.wire);
        const tp = req.tpRank ?? this.opts.defaultTpRank ?? 0;
        const payload = this.#encoded.get(rankKey(req.ppRank, tp));
        if (!payload)
          throw new HandshakeError(
            `no metadata for ${this.wire.requestRanks.length === 1 ? `tp_rank ${tp}` : `(pp_rank ${req.ppRank}, tp_rank ${tp})`} (serving ${this.#ranks()})`,
            'NIXL_ERR_NOT_FOUND',
          );
        answer = replyFrames(payload, this.wire, this.#clock());
        this.stats.served++;
      } catch (e) {
        this.stats.refused++;
        log.warn(`refused a request: ${(e as Error).message}`);
        const code = (e as HandshakeError).code ?? 'NIXL_ERR_INVALID_PARAM';
        answer = errorFrames((e as Error).message, code, this.wire, this.#clock());
      }
      await this.#reply(frames[0], withDelimiter, answer);
    }
  }

  async #reply(identity: Buffer, withDelimiter: boolean, body: Buffer[]): Promise<void> {
    try {
      await this.sock.send(withDelimiter ? [identity, Buffer.alloc(0), ...body] : [identity, ...body]);
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

async function fetchOnce(
  opts: FetchOptions,
  wire: WireProfile,
  timeoutMs: number,
  maxBytes: number,
): Promise<Buffer[]> {
  const sock = new zmq.Request({
    linger: 0,
    receiveTimeout: timeoutMs,
    sendTimeout: timeoutMs,
    immediate: true, // a send to nobody times out instead of queueing forever
    maxMessageSize: maxBytes,
  });
  const onAbort = () => sock.close();
  opts.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    sock.connect(tcp(opts.host, opts.port + checkRank('dpRank', opts.dpRank)));
    await sock.send(encodeMetaRequest(checkRank('tpRank', opts.tpRank), checkRank('ppRank', opts.ppRank), wire));
    return await sock.receive();
  } finally {
    opts.signal?.removeEventListener('abort', onAbort);
    if (!sock.closed) sock.close();
  }
}

/** vLLM's ZeroMQ side channel (ROUTER / REQ), byte-compatible with vLLM's own. */
export const zmqHandshake: HandshakeStrategy = {
  method: 'zmq',
  serve: (opts) => ZmqServer.start(opts),
  async fetch(opts: FetchOptions): Promise<FetchResult> {
    const timeoutMs = fetchTimeoutMs(opts.timeoutMs);
    const maxBytes = fetchMaxResponseBytes(opts.maxResponseBytes);
    const attempts = 1 + (opts.retries ?? 2);
    const wire = wireProfile(opts.wire);
    const where = tcp(opts.host, opts.port + (opts.dpRank ?? 0));
    let last: unknown;
    for (let i = 0; i < attempts; i++) {
      if (opts.signal?.aborted)
        throw new HandshakeError(`handshake with ${where} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal.reason });
      const t0 = monotonicSeconds();
      let frames: Buffer[];
      try {
        frames = await fetchOnce(opts, wire, timeoutMs, maxBytes);
      } catch (e) {
        last = e;
        if (i + 1 < attempts) await retryPause(i, opts.signal);
        continue;
      }
      const t1 = monotonicSeconds();
      const { payload, remoteSeconds } = readReply(frames, wire);
      const p = decodeHandshakePayload(payload);
      return {
        compatibilityHash: p.compatibilityHash,
        metadata: openHandshakePayload(p, opts.expectedHash, wire),
        rttMs: (t1 - t0) * 1000,
        wire: wire.name,
        remoteSeconds,
        clockOffsetS: remoteSeconds === undefined ? undefined : remoteSeconds - (t0 + t1) / 2,
      };
    }
    if (opts.signal?.aborted)
      throw new HandshakeError(`handshake with ${where} aborted`, 'NIXL_ERR_CANCELED', { cause: opts.signal.reason });
    throw new HandshakeError(
      `no answer from ${where} (${wire.name}, pp_rank ${opts.ppRank ?? 0}, tp_rank ${opts.tpRank}) after ${attempts} attempt(s) of ${timeoutMs} ms: ${(last as Error)?.message ?? 'timeout'}`,
      'NIXL_ERR_TIMEOUT',
      { cause: last },
    );
  },
  close() {},
};
