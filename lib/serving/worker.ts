// A Node inference worker for the serving proxy, with the synthetic model
// (synthetic-model.ts): OpenAI-compatible /v1/completions and
// /v1/chat/completions over HTTP, or the proxy's ZeroMQ protocol. One worker
// can act as encoder, prefill and decode:
//   prefill  kv_transfer_params.do_remote_decode: compute the prompt's KV into
//            free blocks, answer with kv_transfer_params (wire profile), hold
//            the blocks until the decode side's read (PrefillTracker) or the
//            lease runs out;
//   decode   kv_transfer_params with remote_block_ids: pull the KV
//            (KvPuller.pullFromParams), check every byte against the prompt,
//            generate words from the KV it holds, stream them or not;
//   encode   a request with images: digest them (what an encoder worker would
//            cache for the prefill), answer with a count;
//   neither  compute the KV locally and generate (an aggregated worker).
import { randomUUID } from 'node:crypto';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import * as zmq from 'zeromq';
import { type EngineKind, NixlAgent } from '../agent';
import { DescList, allocate } from '../descriptors';
import type { HandshakeServer } from '../handshake/types';
import type { WireName } from '../handshake/model';
import { buildKvTransferParams, parseKvTransferParams, wireProfile } from '../handshake/wire';
import { KvPuller, type PullError } from '../kv/puller';
import { LeaseBoard } from '../kv/lease-board';
import { PrefillTracker, servePrefill } from '../kv/prefill';
import type { KvLayout } from '../kv/layout';
import { BlockPool } from './blocks';
import { signKvTransferParams, verifyKvTransferParams } from '../kv/params-auth';
import { type SpanLike, contextFromTraceparent, startSpan } from '../tracing';
import { type RequestError, checkCompletionRequest } from './schema';
import { SerialSender, decodeMessage, encodeMessage, type ZmqReply } from './protocol';
import {
  DEFAULT_MODEL,
  MODEL_NAME,
  type SyntheticModelSpec,
  chatPrompt,
  checkKv,
  computeKv,
  generate,
  numBlocks,
  tokenize,
} from './synthetic-model';

export interface WorkerOptions {
  name?: string;
  transport?: 'http' | 'zmq';
  /** HTTP: interface and port of the API (default 127.0.0.1, any free port). */
  host?: string;
  port?: number;
  /** ZMQ: the PULL address to bind (tcp://host:port, tcp://127.0.0.1:0 for any port, or ipc://path). */
  zmqAddr?: string;
  /** Side channel of this worker's prefill KV (default: host, any free port). */
  sideChannelPort?: number;
  /** KV cache blocks (default 512). */
  blocks?: number;
  model?: SyntheticModelSpec;
  wire?: WireName;
  /** How long a prefill holds KV nobody read (default: the profile's lease, 30 s for v12). */
  leaseMs?: number;
  engine?: EngineKind;
  /** Test hooks: a prefill answers, a decode starts its pull, only after this long. */
  stallPrefillMs?: number;
  stallDecodeMs?: number;
  /** Test hook: blocks freed by lease are overwritten at once (as a reused block would be). */
  poisonFreed?: boolean;
  /** Test hook: this worker's monotonic clock runs this far ahead (negative: behind) of the process's. */
  clockSkewMs?: number;
  /** Largest request body, bytes (default 1 MiB). */
  maxBodyBytes?: number;
  /** HTTP: a request whose headers and body have not all arrived by then is cut (default 30 s). */
  requestTimeoutMs?: number;
  /**
   * A secret shared by the deployment's workers: prefills sign the
   * kv_transfer_params they return, decodes refuse unsigned or forged ones
   * (nothing read). Default: NIXL_NODE_KV_SECRET, else none (vLLM-compatible).
   */
  kvSecret?: string;
}

export interface WorkerStats {
  prefills: number;
  decodes: number;
  encodes: number;
  aggregated: number;
  failed: number;
  verifiedBytes: number;
  badBytes: number;
  freedByRead: number;
  freedByLease: number;
  /** Decode: pulls refused or failed because the prefill's lease ran out (or would have) first. */
  pullsExpired: number;
  /** Prefill: reads reported after a request's lease ran out. */
  lateReads: number;
  /** Prefill: holds released early because the proxy said the decode would not read them. */
  abortedHolds: number;
}

class HttpError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly code = 'invalid_request_error',
  ) {
    super(message);
  }
}

type Sink = {
  /** Streamed: one OpenAI chunk. */
  chunk(c: Record<string, unknown>): void;
  /** The whole answer (not streamed), or the end of a stream. */
  end(status: number, body?: Record<string, unknown>): void;
};

export class Worker {
  readonly name: string;
  readonly stats: WorkerStats = {
    prefills: 0,
    decodes: 0,
    encodes: 0,
    aggregated: 0,
    failed: 0,
    verifiedBytes: 0,
    badBytes: 0,
    freedByRead: 0,
    freedByLease: 0,
    pullsExpired: 0,
    lateReads: 0,
    abortedHolds: 0,
  };
  /** HTTP: the base URL; ZMQ: the address to PUSH to. */
  address = '';
  readonly #o: WorkerOptions;
  readonly #spec: SyntheticModelSpec;
  readonly #agent: NixlAgent;
  readonly #mem: Buffer;
  readonly #blocks: BlockPool;
  readonly #layout: KvLayout;
  readonly #puller: KvPuller;
  readonly #tracker: PrefillTracker;
  /** This worker's monotonic clock, ms (skewed by the test hook). */
  readonly #now: () => number;
  readonly #secret: string | undefined;
  readonly #aborts = new Map<string, AbortController>();
  /** Blocks held for each prefilled request until its read or lease. */
  readonly #held = new Map<string, number[]>();
  #side?: HandshakeServer;
  #http?: http.Server;
  #pull?: zmq.Pull;
  readonly #push = new Map<string, SerialSender>();
  #seq = 0;
  #closed = false;

  constructor(o: WorkerOptions) {
    this.#o = o;
    this.name = o.name ?? `worker-${process.pid}-${randomUUID().slice(0, 8)}`;
    this.#spec = o.model ?? DEFAULT_MODEL;
    const blocks = o.blocks ?? 512;
    this.#blocks = new BlockPool(blocks);
    this.#agent = new NixlAgent(this.name, { engine: o.engine });
    const regionBytes = blocks * this.#spec.blockBytes;
    this.#mem = allocate(this.#spec.layers * regionBytes);
    this.#agent.registerMemory(this.#mem);
    const base = DescList.from(this.#mem).addr(0);
    this.#layout = {
      engineId: this.name,
      tpSize: 1,
      tpRank: 0,
      numBlocks: blocks,
      blockSize: this.#spec.blockSize,
      blockLens: Array(this.#spec.layers).fill(this.#spec.blockBytes),
      baseAddrs: Array.from({ length: this.#spec.layers }, (_, l) => base + BigInt(l * regionBytes)),
      kvCacheLayout: 'LBHNC',
      totalNumKvHeads: 8,
    };
    this.#secret = o.kvSecret ?? process.env.NIXL_NODE_KV_SECRET ?? undefined;
    this.#puller = new KvPuller({
      agent: this.#agent,
      layout: this.#layout,
      wire: o.wire,
      kvLeaseMs: o.leaseMs,
      paramsSecret: this.#secret,
    });
    const skew = o.clockSkewMs ?? 0;
    this.#now = () => performance.now() + skew;
    this.#tracker = new PrefillTracker({
      agent: this.#agent,
      tpSize: 1,
      wire: o.wire,
      leaseMs: o.leaseMs,
      now: this.#now,
      logger: { warn() {} },
      // nixl-node decodes confirm each read against it; vLLM decodes never look.
      board: new LeaseBoard(),
    });
    this.#tracker.sinks.add({
      released: (r) => {
        if (r.reason === 'read') this.stats.freedByRead++;
        else if (r.reason === 'aborted') this.stats.abortedHolds++;
        else this.stats.freedByLease++;
      },
      unrecognized: () => {},
      lateRead: () => this.stats.lateReads++,
    });
  }

  /**
   * Frees at once the blocks a prefilled request holds, when its decode will
   * not read them (it failed, or the client went away): the proxy says so.
   */
  releaseHold(remoteRequestId: unknown): boolean {
    if (typeof remoteRequestId !== 'string') throw new HttpError(400, "'remote_request_id' must be a string");
    return this.#tracker.abort(remoteRequestId);
  }

  /** KV blocks free right now. */
  get freeBlocks(): number {
    return this.#blocks.available;
  }

  #block(id: number, layer: number): Buffer {
    const at = (layer * this.#blocks.size + id) * this.#spec.blockBytes;
    return this.#mem.subarray(at, at + this.#spec.blockBytes);
  }

  async start(): Promise<this> {
    const host = this.#o.host ?? '127.0.0.1';
    this.#side = await servePrefill({
      ranks: [{ agent: this.#agent, layout: this.#layout, leaseBoard: this.#tracker.board }],
      compatibilityHash: `synthetic:${JSON.stringify(this.#spec)}`,
      host,
      port: this.#o.sideChannelPort ?? 0,
      wire: this.#o.wire,
      logger: { warn() {} },
      // The clock its v12 replies carry: the one remote_blocks_expiry_time is on.
      clock: () => this.#now() / 1000,
    });
    if ((this.#o.transport ?? 'http') === 'http') {
      const requestTimeout = this.#o.requestTimeoutMs ?? 30_000;
      this.#http = http.createServer(
        // A body that trickles in is cut after requestTimeout, checked every second.
        { requestTimeout, headersTimeout: Math.min(requestTimeout, 10_000), connectionsCheckingInterval: 1000 },
        (req, res) => void this.#onHttp(req, res),
      );
      await new Promise<void>((resolve, reject) => {
        this.#http!.once('error', reject);
        this.#http!.listen(this.#o.port ?? 0, host, () => resolve());
      });
      this.address = `http://${host}:${(this.#http.address() as AddressInfo).port}`;
    } else {
      this.#pull = new zmq.Pull({ linger: 0, maxMessageSize: this.#o.maxBodyBytes ?? 1 << 20 });
      await this.#pull.bind(this.#o.zmqAddr ?? `tcp://${host}:*`);
      this.address = this.#pull.lastEndpoint!;
      void this.#zmqLoop();
    }
    return this;
  }

  // ---- the model ----------------------------------------------------------

  #prompt(path: string, body: Record<string, unknown>): string {
    if (path === '/v1/chat/completions') {
      if (!Array.isArray(body.messages)) throw new HttpError(400, "'messages' must be an array");
      return chatPrompt(body.messages);
    }
    if (typeof body.prompt !== 'string') throw new HttpError(400, "'prompt' must be a string");
    return body.prompt;
  }

  /** One request in its own span, a child of the proxy's stage span (traceparent) when there is one. */
  async #handle(
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    traceparent?: unknown,
  ): Promise<void> {
    const span = startSpan('worker.request', {
      kind: 'server',
      parent: contextFromTraceparent(traceparent),
      attributes: { 'http.route': path, 'nixl_node.worker': this.name, 'nixl_node.request_id': requestId },
    });
    try {
      await this.#serve(path, body, requestId, signal, sink, span);
    } catch (e) {
      span.fail(e);
      if (e instanceof HttpError) span.setAttribute('http.response.status_code', e.status);
      throw e;
    } finally {
      span.end();
    }
  }

  async #serve(
    path: string,
    body: Record<string, unknown>,
    requestId: string,
    signal: AbortSignal,
    sink: Sink,
    span: SpanLike,
  ) {
    const arrivedMs = performance.now();
    if (path !== '/v1/completions' && path !== '/v1/chat/completions') throw new HttpError(404, `no route ${path}`);
    try {
      checkCompletionRequest(path, body, { kvTransferParams: 'object' });
    } catch (e) {
      throw new HttpError((e as RequestError).status ?? 400, (e as Error).message);
    }
    const prompt = this.#prompt(path, body);
    const tokens = tokenize(prompt);
    const kvp = body.kv_transfer_params as Record<string, unknown> | undefined;
    const n = numBlocks(tokens.length, this.#spec);
    if (n > this.#blocks.size)
      throw new HttpError(
        413,
        `the prompt needs ${n} KV blocks of ${this.#spec.blockSize} tokens; this worker's KV cache holds ${this.#blocks.size}`,
      );
    const maxTokens = Number(body.max_tokens ?? body.max_completion_tokens ?? 16);
    if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > 4096)
      throw new HttpError(400, "'max_tokens' must be an integer from 1 to 4096");
    const chat = path === '/v1/chat/completions';

    if (hasImages(body) && kvp === undefined) {
      span.setAttribute('nixl_node.role', 'encode');
      this.stats.encodes++;
      sink.end(200, { id: requestId, object: 'encode', model: MODEL_NAME, mm_items: countImages(body) });
      return;
    }
    if (kvp?.do_remote_decode === true) {
      // Prefill for a remote decode.
      span.setAttribute('nixl_node.role', 'prefill');
      const ids = this.#take(n);
      computeKv(tokens, this.#spec, (b, l) => this.#block(ids[b], l));
      // Never made of client input: it travels in notifications ("<id>:<n>", "HB:<id>,...").
      const remoteRequestId = `kv-${++this.#seq}-${randomUUID()}`;
      this.#held.set(remoteRequestId, ids);
      // The hold outlives this request's span: it ends when the blocks go back.
      const hold = startSpan('kv.hold', {
        parent: span.context,
        attributes: { 'nixl_node.remote_request_id': remoteRequestId, 'nixl_node.blocks': ids.length },
      });
      void this.#tracker.expect(remoteRequestId, ids).then((r) => {
        hold.setAttribute('nixl_node.release_reason', r.reason === 'expired' ? 'lease' : r.reason);
        hold.end();
        this.#held.delete(remoteRequestId);
        if (r.reason !== 'read' && this.#o.poisonFreed)
          for (const id of ids) for (let l = 0; l < this.#spec.layers; l++) this.#block(id, l).fill(0xa5);
        this.#blocks.give(ids);
      });
      if (this.#o.stallPrefillMs) await sleep(this.#o.stallPrefillMs, signal);
      if (signal.aborted) {
        // Nobody will get the params, so nobody will read the blocks.
        this.#tracker.abort(remoteRequestId);
        throw new HttpError(499, 'the proxy went away', 'aborted');
      }
      this.stats.prefills++;
      const params = buildKvTransferParams(
        {
          remoteBlockIds: [ids],
          remoteEngineId: this.name,
          remoteRequestId,
          remoteHost: this.#side!.host,
          remotePort: this.#side!.basePort,
          tpSize: 1,
          remoteNumTokens: tokens.length,
          // When the tracker frees the blocks unless read, on the clock the
          // side channel sends (performance.now, seconds), as vLLM does.
          remoteBlocksExpiryTime: expirySeconds(this.#tracker, remoteRequestId),
        },
        this.#o.wire,
      );
      sink.end(200, {
        ...completion(requestId, chat, [], 'length'),
        kv_transfer_params: this.#secret === undefined ? params : signKvTransferParams(params, this.#secret),
        // The proxy may release the hold early (POST /v1/kv/release, or RELEASE over ZeroMQ).
        nixl_node: { worker: this.name, kv_release: true },
      });
      return;
    }
    if (kvp !== undefined && kvp.remote_engine_id === this.name) {
      // Prefilled here (one worker in both pools): the KV is in our own blocks; read it in place.
      span.setAttribute('nixl_node.role', 'decode-in-place');
      let p: ReturnType<typeof parseKvTransferParams>;
      try {
        if (this.#secret !== undefined) verifyKvTransferParams(kvp, this.#secret);
        p = parseKvTransferParams(kvp, this.#o.wire);
      } catch (e) {
        throw new HttpError(400, `kv_transfer_params: ${(e as Error).message}`);
      }
      const held = this.#held.get(p.remoteRequestId);
      // Only blocks this worker holds for exactly that request (anything else is forged or expired).
      if (!held || held.join() !== p.remoteBlockIds[0]?.join())
        throw new HttpError(
          400,
          `request '${p.remoteRequestId}' holds no such blocks here (expired, or not prefilled here)`,
        );
      if (held.length !== n)
        throw new HttpError(400, `kv_transfer_params name ${held.length} blocks; the prompt needs ${n}`);
      try {
        const bad = checkKv(tokens, this.#spec, (b, l) => this.#block(held[b], l));
        if (bad > 0) throw new HttpError(500, `${bad} bytes of the held KV differ from the prompt's`, 'kv_mismatch');
        this.stats.verifiedBytes += n * this.#spec.layers * this.#spec.blockBytes;
        this.stats.decodes++;
        await this.#answer(requestId, chat, body.stream === true, signal, sink, held, n, maxTokens, {
          worker: this.name,
          verified_bytes: n * this.#spec.layers * this.#spec.blockBytes,
          kv_blocks: n,
          kv_moved: false,
        });
      } finally {
        this.#tracker.release(p.remoteRequestId);
      }
      return;
    }
    const ids = this.#take(n);
    try {
      let verified = 0;
      if (kvp !== undefined) {
        // Decode: the KV comes from the prefill named in kv_transfer_params.
        if (this.#o.stallDecodeMs) await sleep(this.#o.stallDecodeMs, signal);
        try {
          span.setAttribute('nixl_node.role', 'decode');
          await this.#puller.pullFromParams(kvp, {
            traceContext: span.context,
            localBlockIds: ids,
            signal,
            timeoutMs: 30_000,
            issuedAtMs: arrivedMs,
          });
        } catch (e) {
          const err = e as PullError;
          if (err.kind === 'expired') {
            // Not this worker's fault nor the client's: the proxy prefills again.
            this.stats.pullsExpired++;
            throw new HttpError(503, `KV pull failed (expired): ${err.message}`, 'kv_expired');
          }
          // What the params name does not fit (bad ids, sizes, a layout the
          // peer does not have): the request's fault, not this worker's.
          const refused = err.kind === 'setup' || err.code === 'NIXL_ERR_MISMATCH';
          throw new HttpError(refused ? 400 : 502, `KV pull failed (${err.kind}): ${err.message}`, err.code);
        }
        const bad = checkKv(tokens, this.#spec, (b, l) => this.#block(ids[b], l));
        if (bad > 0) {
          this.stats.badBytes += bad;
          throw new HttpError(500, `${bad} bytes of the pulled KV differ from the prompt's`, 'kv_mismatch');
        }
        verified = n * this.#spec.layers * this.#spec.blockBytes;
        this.stats.verifiedBytes += verified;
        this.stats.decodes++;
      } else {
        computeKv(tokens, this.#spec, (b, l) => this.#block(ids[b], l));
        span.setAttribute('nixl_node.role', 'aggregated');
        this.stats.aggregated++;
      }
      await this.#answer(requestId, chat, body.stream === true, signal, sink, ids, n, maxTokens, {
        worker: this.name,
        verified_bytes: verified,
        kv_blocks: n,
        kv_moved: kvp !== undefined,
      });
    } finally {
      this.#blocks.give(ids);
    }
  }

  /** Generates from the KV in `ids` and answers, streamed or not. */
  async #answer(
    requestId: string,
    chat: boolean,
    stream: boolean,
    signal: AbortSignal,
    sink: Sink,
    ids: readonly number[],
    n: number,
    maxTokens: number,
    info: Record<string, unknown>,
  ): Promise<void> {
    const words = generate((b, l) => this.#block(ids[b], l), n, this.#spec, maxTokens);
    const extra = { nixl_node: info };
    if (!stream) {
      sink.end(200, { ...completion(requestId, chat, words, 'length'), ...extra });
      return;
    }
    for (const [i, w] of words.entries()) {
      if (signal.aborted) return;
      sink.chunk(chunk(requestId, chat, i === 0 ? w : ` ${w}`, null));
      if (i % 4 === 3) await new Promise((r) => setImmediate(r));
    }
    sink.chunk({ ...chunk(requestId, chat, '', 'length'), ...extra });
    sink.end(200);
  }

  #take(n: number): number[] {
    const ids = this.#blocks.take(n);
    if (!ids)
      throw new HttpError(503, `KV cache full: ${n} blocks wanted, ${this.#blocks.available} free`, 'kv_cache_full');
    return ids;
  }

  // ---- HTTP ---------------------------------------------------------------

  async #onHttp(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const json = (status: number, body: unknown) => {
      if (res.headersSent) return void res.end();
      const text = JSON.stringify(body);
      res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
      res.end(text);
    };
    const path = (req.url ?? '').split('?')[0];
    if (req.method === 'GET' && path === '/health')
      return json(200, { status: 'ok', name: this.name, free_blocks: this.freeBlocks });
    if (req.method !== 'POST') return json(405, errorBody('only POST', 'invalid_request_error'));
    if (path === '/v1/kv/release') {
      try {
        const b = await readJson(req, 4096);
        return json(200, { released: this.releaseHold(b.remote_request_id) });
      } catch (e) {
        const h = e instanceof HttpError ? e : new HttpError(400, (e as Error).message);
        return json(h.status, errorBody(h.message, h.code));
      }
    }
    const ac = new AbortController();
    res.on('close', () => {
      if (!res.writableFinished) ac.abort();
    });
    try {
      const body = await readJson(req, this.#o.maxBodyBytes ?? 1 << 20);
      const rid = String(req.headers['x-request-id'] ?? randomUUID());
      let streaming = false;
      await this.#handle(
        path,
        body,
        rid,
        ac.signal,
        {
          chunk: (c) => {
            if (!streaming) {
              streaming = true;
              res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
            }
            res.write(`data: ${JSON.stringify(c)}\n\n`);
          },
          end: (status, b) => {
            if (streaming) res.end('data: [DONE]\n\n');
            else json(status, b);
          },
        },
        req.headers.traceparent,
      );
    } catch (e) {
      this.stats.failed++;
      const h = e instanceof HttpError ? e : new HttpError(500, (e as Error).message, 'internal_error');
      json(h.status, errorBody(h.message, h.code));
    }
  }

  // ---- ZeroMQ -------------------------------------------------------------

  async #zmqLoop(): Promise<void> {
    for (;;) {
      let frames: Buffer[];
      try {
        frames = await this.#pull!.receive();
      } catch {
        return; // closed
      }
      let msg: ReturnType<typeof decodeMessage>;
      try {
        msg = decodeMessage(frames);
      } catch {
        continue; // garbage: nobody to answer
      }
      const b = msg.body as {
        msg_id: string;
        reply_to?: string;
        path?: string;
        request_id?: string;
        payload?: unknown;
      };
      if (msg.tag === 'ABORT') {
        this.#aborts.get(b.msg_id)?.abort();
        continue;
      }
      if (msg.tag === 'RELEASE') {
        this.releaseHold((b as { remote_request_id?: unknown }).remote_request_id);
        continue;
      }
      if (typeof b.reply_to !== 'string') continue;
      const reply = (tag: 'ENCODE' | 'GENERATION' | 'FAILURE' | 'HEALTH', r: ZmqReply) =>
        this.#reply(b.reply_to!, tag, r);
      if (msg.tag === 'HEALTH') {
        void reply('HEALTH', { msg_id: b.msg_id, ok: true, name: this.name });
        continue;
      }
      if (msg.tag !== 'ENCODE' && msg.tag !== 'GENERATION') continue;
      const ac = new AbortController();
      this.#aborts.set(b.msg_id, ac);
      const tag = msg.tag;
      void (async () => {
        try {
          if (typeof b.payload !== 'object' || b.payload === null || Array.isArray(b.payload))
            throw new HttpError(400, 'payload must be a map');
          await this.#handle(
            String(b.path ?? '/v1/completions'),
            b.payload as Record<string, unknown>,
            String(b.request_id ?? b.msg_id),
            ac.signal,
            {
              chunk: (c) => void reply(tag, { msg_id: b.msg_id, chunk: c, done: false }),
              end: (status, body) => void reply(tag, { msg_id: b.msg_id, status, payload: body, done: true }),
            },
            (b as { traceparent?: unknown }).traceparent,
          );
        } catch (e) {
          this.stats.failed++;
          const h = e instanceof HttpError ? e : new HttpError(500, (e as Error).message, 'internal_error');
          void reply('FAILURE', { msg_id: b.msg_id, status: h.status, error: { message: h.message, code: h.code } });
        } finally {
          this.#aborts.delete(b.msg_id);
        }
      })();
    }
  }

  async #reply(to: string, tag: 'ENCODE' | 'GENERATION' | 'FAILURE' | 'HEALTH', r: ZmqReply): Promise<void> {
    if (this.#closed) return;
    let s = this.#push.get(to);
    if (!s) {
      const sock = new zmq.Push({ linger: 0, sendTimeout: 5000 });
      sock.connect(to);
      s = new SerialSender(sock);
      this.#push.set(to, s);
    }
    try {
      await s.send(encodeMessage(tag, r));
    } catch {
      /* the proxy is gone; it times the request out */
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const a of this.#aborts.values()) a.abort();
    if (this.#http) {
      this.#http.closeAllConnections();
      await new Promise((r) => this.#http!.close(r));
    }
    this.#pull?.close();
    for (const s of this.#push.values()) s.socket.close();
    await this.#side?.close();
    await this.#puller.close();
    await this.#tracker.close();
    this.#agent.close();
  }
}

export async function startWorker(o: WorkerOptions = {}): Promise<Worker> {
  wireProfile(o.wire); // a bad profile fails before anything starts
  return new Worker(o).start();
}

// ---- helpers ----------------------------------------------------------------

export function hasImages(body: Record<string, unknown>): boolean {
  return countImages(body) > 0;
}

function countImages(body: Record<string, unknown>): number {
  if (!Array.isArray(body.messages)) return 0;
  let n = 0;
  for (const m of body.messages as Array<{ content?: unknown }>)
    if (Array.isArray(m?.content)) for (const p of m.content) if ((p as { type?: string })?.type === 'image_url') n++;
  return n;
}

function completion(id: string, chat: boolean, words: string[], finish: string): Record<string, unknown> {
  const text = words.join(' ');
  const created = Math.floor(Date.now() / 1000);
  return chat
    ? {
        id,
        object: 'chat.completion',
        created,
        model: MODEL_NAME,
        choices: [{ index: 0, message: { role: 'assistant', content: text }, finish_reason: finish }],
        usage: { completion_tokens: words.length },
      }
    : {
        id,
        object: 'text_completion',
        created,
        model: MODEL_NAME,
        choices: [{ index: 0, text, finish_reason: finish }],
        usage: { completion_tokens: words.length },
      };
}

function chunk(id: string, chat: boolean, text: string, finish: string | null): Record<string, unknown> {
  return chat
    ? {
        id,
        object: 'chat.completion.chunk',
        model: MODEL_NAME,
        choices: [{ index: 0, delta: { content: text }, finish_reason: finish }],
      }
    : { id, object: 'text_completion', model: MODEL_NAME, choices: [{ index: 0, text, finish_reason: finish }] };
}

export function errorBody(message: string, type: string, extra: Record<string, unknown> = {}): Record<string, unknown> {
  return { error: { message, type, ...extra } };
}

/** Reads a JSON object body of at most max bytes; 400 / 413 otherwise. */
export async function readJson(req: http.IncomingMessage, max: number): Promise<Record<string, unknown>> {
  const declared = Number(req.headers['content-length'] ?? 0);
  if (declared > max) throw new HttpError(413, `body larger than ${max} bytes`);
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const c of req) {
    size += (c as Buffer).length;
    if (size > max) throw new HttpError(413, `body larger than ${max} bytes`);
    chunks.push(c as Buffer);
  }
  let v: unknown;
  try {
    v = JSON.parse(Buffer.concat(chunks).toString('utf8'));
  } catch {
    throw new HttpError(400, 'body is not JSON');
  }
  if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new HttpError(400, 'body must be a JSON object');
  return v as Record<string, unknown>;
}

export { HttpError };

function expirySeconds(tracker: PrefillTracker, requestId: string): number | null {
  const ms = tracker.leaseExpiry(requestId);
  return ms === undefined ? null : ms / 1000;
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(t);
      resolve();
    });
  });
}
