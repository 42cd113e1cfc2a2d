// How the proxy reaches a worker for one stage: HTTP (real vLLM OpenAI
// servers, or Node workers), or ZeroMQ (protocol.ts). Both give back the
// status and JSON of an answer, or its stream of chunks, and both honour an
// AbortSignal (client gone, or the stage timed out).
import { randomUUID } from 'node:crypto';
import { Agent, type Dispatcher } from 'undici';
import * as zmq from 'zeromq';
import type { Stage, WorkerRef } from './pool';
import { parseKvEvents } from '../fleet/record';
import { SerialSender, decodeMessage, encodeMessage, type Tag } from '../api/zmq-protocol';

/** One stage of a request, as the proxy sends it to a worker. */
export interface StageCall {
  stage: Stage;
  worker: WorkerRef;
  path: string;
  body: Record<string, unknown>;
  requestId: string;
  signal: AbortSignal;
  /** The answer is an SSE stream of chunks. */
  stream: boolean;
  /** W3C trace context of the stage's span: the worker's spans are its children. */
  traceparent?: string;
  /**
   * Prefill: the max_tokens its decode will generate, so that a nixl-node
   * worker refuses a prompt that cannot fit with them before evaluating it
   * (HTTP header x-nixl-node-decode-max-tokens; ZeroMQ field decode_max_tokens).
   */
  decodeMaxTokens?: number;
}

/** A worker's answer to a stage: a whole body, or a stream of chunks. */
export interface StageAnswer {
  status: number;
  /** Not streamed (or an error): the JSON body. */
  json?: Record<string, unknown>;
  /** Streamed: OpenAI chunk objects, in order. */
  chunks?: AsyncIterable<Record<string, unknown>>;
}

/** The worker could not be reached or broke the connection (not an answer it gave). */
export class TransportError extends Error {
  constructor(
    message: string,
    readonly aborted = false,
  ) {
    super(message);
  }
}

/** How the proxy talks to workers: HTTP, or ZeroMQ. */
export interface WorkerTransport {
  readonly kind: 'http' | 'zmq';
  /** Sends one stage of a request to a worker. */
  call(c: StageCall): Promise<StageAnswer>;
  /** True when the worker answers a health check in time. */
  health(w: WorkerRef, timeoutMs: number): Promise<boolean>;
  /** A health check, and why it failed: ECONNREFUSED, a timeout, the status and reason the worker gave. */
  healthCheck(w: WorkerRef, timeoutMs: number): Promise<HealthResult>;
  /**
   * Tells a prefill worker to free the KV blocks it holds for a request now
   * (its decode failed or its client went away). Best effort: the lease frees
   * them anyway.
   */
  release(w: WorkerRef, remoteRequestId: string): Promise<void>;
  /**
   * Tells a prefill worker to free whatever it holds or is prefilling for
   * the proxy's request id (the client went away, or the stage timed out,
   * before its answer arrived: the proxy never learned the hold's id).
   * nixl-node workers only; best effort.
   */
  releaseRequest(w: WorkerRef, requestId: string): Promise<void>;
  /** Closes the transport's sockets. */
  close(): Promise<void>;
}

// ---- HTTP ---------------------------------------------------------------------

async function* sseChunks(body: AsyncIterable<Uint8Array>): AsyncIterable<Record<string, unknown>> {
  const dec = new TextDecoder();
  let buf = '';
  for await (const part of body) {
    buf += dec.decode(part, { stream: true });
    for (let i = buf.indexOf('\n\n'); i >= 0; i = buf.indexOf('\n\n')) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') return;
        yield JSON.parse(data) as Record<string, unknown>;
      }
    }
  }
}

/**
 * Workers as OpenAI HTTP servers (vLLM's, or nixl-node's), reached through
 * one undici Agent: a pool of keep-alive connections per worker, and its
 * `request` (no WHATWG streams, Request or Response objects per call, which
 * made the global fetch most of the proxy's CPU per request).
 */
export class HttpTransport implements WorkerTransport {
  readonly kind = 'http' as const;
  readonly #agent = new Agent({ keepAliveTimeout: 10_000 });

  /** Sends one stage over HTTP. */
  async call(c: StageCall): Promise<StageAnswer> {
    const headers: Record<string, string> = { 'content-type': 'application/json', 'x-request-id': c.requestId };
    if (c.traceparent) headers.traceparent = c.traceparent;
    if (c.decodeMaxTokens) headers['x-nixl-node-decode-max-tokens'] = String(c.decodeMaxTokens);
    let res: Dispatcher.ResponseData;
    try {
      res = await this.#agent.request({
        ...target(c.worker.address, c.path),
        method: 'POST',
        headers,
        body: JSON.stringify(c.body),
        signal: c.signal,
      });
    } catch (e) {
      throw new TransportError(`${c.worker.address}: ${causeOf(e)}`, c.signal.aborted);
    }
    try {
      const type = res.headers['content-type'];
      if (c.stream && res.statusCode < 300 && String(type ?? '').includes('text/event-stream'))
        return { status: res.statusCode, chunks: sseChunks(res.body) };
      const text = await res.body.text();
      let json: Record<string, unknown>;
      try {
        json = JSON.parse(text);
      } catch {
        json = { error: { message: `worker answered HTTP ${res.statusCode} with no JSON: ${text.slice(0, 200)}` } };
      }
      return { status: res.statusCode, json };
    } catch (e) {
      throw new TransportError(`${c.worker.address}: ${causeOf(e)}`, c.signal.aborted);
    }
  }

  async health(w: WorkerRef, timeoutMs: number): Promise<boolean> {
    return (await this.healthCheck(w, timeoutMs)).ok;
  }

  /** GET /health. */
  async healthCheck(w: WorkerRef, timeoutMs: number): Promise<HealthResult> {
    try {
      const signal = AbortSignal.timeout(timeoutMs);
      const r = await this.#agent.request({ ...target(w.address, '/health'), method: 'GET', signal });
      const text = await r.body.text();
      const body = parseObject(text);
      const ok = r.statusCode >= 200 && r.statusCode < 300;
      if (ok) healthFields(w, body);
      return ok ? { ok: true } : { ok: false, cause: `HTTP ${r.statusCode}${reasonOf(body)}` };
    } catch (e) {
      const err = e as Error;
      if (err?.name === 'TimeoutError' || (err as { cause?: Error })?.cause?.name === 'TimeoutError')
        return { ok: false, cause: `no answer in ${timeoutMs} ms (timeout)` };
      return { ok: false, cause: causeOf(e) };
    }
  }

  async release(w: WorkerRef, remoteRequestId: string): Promise<void> {
    await this.#release(w, { remote_request_id: remoteRequestId });
  }

  async releaseRequest(w: WorkerRef, requestId: string): Promise<void> {
    await this.#release(w, { request_id: requestId });
  }

  async #release(w: WorkerRef, body: Record<string, string>): Promise<void> {
    try {
      const r = await this.#agent.request({
        ...target(w.address, '/v1/kv/release'),
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(body),
        signal: AbortSignal.timeout(2000),
      });
      await r.body.dump();
    } catch {
      /* gone: its lease frees them */
    }
  }

  /** Closes the pooled connections (calls in flight fail). */
  async close(): Promise<void> {
    await this.#agent.destroy().catch(() => {});
  }
}

/** A worker's base URL (which may have a path) split as undici takes it, kept per address. */
const targets = new Map<string, { origin: string; base: string }>();
function target(address: string, path: string): { origin: string; path: string } {
  let t = targets.get(address);
  if (!t) {
    const u = new URL(address);
    t = { origin: u.origin, base: u.pathname.replace(/\/+$/, '') };
    // Addresses come and go with a fleet: the cache stays small.
    if (targets.size >= 1024) targets.clear();
    targets.set(address, t);
  }
  return { origin: t.origin, path: t.base + path };
}

/** What a health check found. */
export interface HealthResult {
  ok: boolean;
  /** Why not, when not ok. */
  cause?: string;
}

/** ': <reason>' from a worker's unhealthy answer (nixl-node: reason; vLLM: error.message), or ''. */
function reasonOf(body: Record<string, unknown> | undefined): string {
  const r = body?.reason ?? (body?.error as { message?: unknown } | undefined)?.message;
  return typeof r === 'string' && r.length > 0 ? `: ${r.slice(0, 200)}` : '';
}

function causeOf(e: unknown): string {
  const err = e as Error & { code?: string; cause?: { code?: string; message?: string } };
  return (
    err.cause?.code ?? err.cause?.message ?? (err.code?.startsWith('UND_ERR') ? err.message : err.code) ?? err.message
  );
}

// ---- ZeroMQ -------------------------------------------------------------------

interface Pending {
  push(tag: Tag, body: Record<string, unknown>): void;
  fail(e: Error): void;
}

/** PUSH to each worker, one PULL bound here for every reply. */
export class ZmqTransport implements WorkerTransport {
  readonly kind = 'zmq' as const;
  readonly #pull = new zmq.Pull({ linger: 0, maxMessageSize: 64 << 20 });
  readonly #push = new Map<string, { sender: SerialSender; connected: Promise<boolean> }>();
  readonly #pending = new Map<string, Pending>();
  replyAddress = '';
  /** Replies dropped because they could not be read (not two frames, not a msgpack map, no msg_id). */
  repliesDropped = 0;
  #closed = false;

  /** Binds the PULL socket workers answer on. */
  async bind(addr = 'tcp://127.0.0.1:*'): Promise<this> {
    await this.#pull.bind(addr);
    this.replyAddress = this.#pull.lastEndpoint!;
    void this.#loop();
    return this;
  }

  async #loop(): Promise<void> {
    for (;;) {
      let frames: Buffer[];
      try {
        frames = await this.#pull.receive();
      } catch {
        return;
      }
      try {
        const { tag, body } = decodeMessage(frames);
        this.#pending.get(body.msg_id as string)?.push(tag, body);
      } catch {
        this.repliesDropped++; // garbage from a worker (or whoever reached this socket)
      }
    }
  }

  #socket(address: string): { sender: SerialSender; connected: Promise<boolean> } {
    let s = this.#push.get(address);
    if (!s) {
      // immediate + sendTimeout 0: a message to a worker that is not connected
      // (dead, or restarting) fails at once instead of queueing. A timeout
      // here made every send queued behind it wait too (one send at a time):
      // after a worker was killed, health checks and requests to it backed up
      // for seconds and a restarted worker was readmitted late.
      const sock = new zmq.Push({ linger: 0, sendTimeout: 0, immediate: true });
      // A new socket connects in the background: its first sends wait for
      // that (up to a second), later ones never wait. The observer is set
      // before connect(), or it may miss the handshake.
      let timer: NodeJS.Timeout | undefined;
      const connected = new Promise<boolean>((resolve) => {
        timer = setTimeout(() => resolve(false), 1000);
        // 'handshake': the ZMTP handshake is done, so an immediate socket has a pipe to send on.
        sock.events.on('handshake', () => {
          clearTimeout(timer);
          resolve(true);
        });
      });
      try {
        // Throws on an address ZeroMQ cannot take (http://, a bad port):
        // nothing keeps the socket then, so it is closed here.
        sock.connect(address);
      } catch (e) {
        clearTimeout(timer);
        sock.close();
        throw e;
      }
      s = { sender: new SerialSender(sock), connected };
      this.#push.set(address, s);
    }
    return s;
  }

  async #send(address: string, tag: Tag, body: Record<string, unknown>): Promise<void> {
    try {
      const s = this.#socket(address);
      await s.connected;
      await s.sender.send(encodeMessage(tag, body as never));
    } catch (e) {
      throw new TransportError(`${address}: cannot send (${(e as Error).message})`);
    }
  }

  /** Sends one stage over ZeroMQ and collects its reply (or stream). */
  async call(c: StageCall): Promise<StageAnswer> {
    const msgId = `${c.requestId}/${randomUUID()}`;
    // Replies arrive in order on one socket; a queue hands them to the reader.
    const queue: Array<{ tag: Tag; body: Record<string, unknown> }> = [];
    let wake: (() => void) | undefined;
    let failure: Error | undefined;
    this.#pending.set(msgId, {
      push: (tag, body) => {
        queue.push({ tag, body });
        wake?.();
      },
      fail: (e) => {
        failure = e;
        wake?.();
      },
    });
    const onAbort = () => {
      failure = new TransportError(`${c.worker.address}: aborted`, true);
      void this.#send(c.worker.address, 'ABORT', { msg_id: msgId }).catch(() => {});
      wake?.();
    };
    c.signal.addEventListener('abort', onAbort, { once: true });
    const done = () => {
      c.signal.removeEventListener('abort', onAbort);
      this.#pending.delete(msgId);
    };
    const next = async (): Promise<{ tag: Tag; body: Record<string, unknown> }> => {
      while (queue.length === 0) {
        if (failure) throw failure;
        await new Promise<void>((r) => (wake = r));
        wake = undefined;
      }
      return queue.shift()!;
    };
    try {
      await this.#send(c.worker.address, c.stage === 'encode' ? 'ENCODE' : 'GENERATION', {
        msg_id: msgId,
        request_id: c.requestId,
        path: c.path,
        reply_to: this.replyAddress,
        payload: c.body,
        ...(c.traceparent ? { traceparent: c.traceparent } : {}),
        ...(c.decodeMaxTokens ? { decode_max_tokens: c.decodeMaxTokens } : {}),
      });
      const first = await next();
      const answer = (m: { tag: Tag; body: Record<string, unknown> }): StageAnswer =>
        m.tag === 'FAILURE'
          ? { status: Number(m.body.status ?? 500), json: { error: m.body.error } }
          : { status: Number(m.body.status ?? 200), json: m.body.payload as Record<string, unknown> };
      if (first.body.done !== false) {
        done();
        return answer(first);
      }
      const chunks = async function* (): AsyncIterable<Record<string, unknown>> {
        try {
          for (let m = first; ; m = await next()) {
            if (m.tag === 'FAILURE')
              throw new TransportError(`worker failed mid-stream: ${JSON.stringify(m.body.error)}`);
            if (m.body.chunk) yield m.body.chunk as Record<string, unknown>;
            if (m.body.done !== false) return;
          }
        } finally {
          done();
        }
      };
      return { status: 200, chunks: chunks() };
    } catch (e) {
      done();
      throw e;
    }
  }

  async health(w: WorkerRef, timeoutMs: number): Promise<boolean> {
    return (await this.healthCheck(w, timeoutMs)).ok;
  }

  /** A HEALTH message, answered in time. */
  async healthCheck(w: WorkerRef, timeoutMs: number): Promise<HealthResult> {
    const msgId = `health/${randomUUID()}`;
    return new Promise<HealthResult>((resolve) => {
      const t = setTimeout(
        () => finish({ ok: false, cause: `no HEALTH answer in ${timeoutMs} ms (timeout)` }),
        timeoutMs,
      );
      const finish = (r: HealthResult) => {
        clearTimeout(t);
        this.#pending.delete(msgId);
        resolve(r);
      };
      this.#pending.set(msgId, {
        push: (tag, body) => {
          if (tag === 'HEALTH') healthFields(w, body);
          if (tag === 'HEALTH' && body.ok === true) finish({ ok: true });
          else finish({ ok: false, cause: tag === 'HEALTH' ? `unhealthy${reasonOf(body)}` : `answered ${tag}` });
        },
        fail: (e) => finish({ ok: false, cause: e.message }),
      });
      this.#send(w.address, 'HEALTH', { msg_id: msgId, reply_to: this.replyAddress }).catch((e: Error) =>
        finish({ ok: false, cause: causeOf(e) }),
      );
    });
  }

  async release(w: WorkerRef, remoteRequestId: string): Promise<void> {
    await this.#send(w.address, 'RELEASE', {
      msg_id: `release/${randomUUID()}`,
      remote_request_id: remoteRequestId,
    }).catch(() => {});
  }

  async releaseRequest(w: WorkerRef, requestId: string): Promise<void> {
    await this.#send(w.address, 'RELEASE', { msg_id: `release/${randomUUID()}`, request_id: requestId }).catch(
      () => {},
    );
  }

  /** Closes the sockets; calls in flight fail. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    for (const p of this.#pending.values()) p.fail(new TransportError('proxy closing'));
    this.#pull.close();
    for (const s of this.#push.values()) s.sender.socket.close();
  }
}

/** A JSON object, or undefined (vLLM's /health answers an empty body). */
function parseObject(text: string): Record<string, unknown> | undefined {
  try {
    const v = JSON.parse(text) as unknown;
    return typeof v === 'object' && v !== null && !Array.isArray(v) ? (v as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}

/** What a nixl-node worker's health answer says of its model: its name and context size. */
function healthFields(w: WorkerRef, h: Record<string, unknown> | undefined): void {
  if (typeof h?.model === 'string' && h.model.length <= 256) w.model = h.model;
  w.models = servedNames(h, w.model) ?? w.models;
  const len = h?.max_model_len;
  if (Number.isSafeInteger(len) && (len as number) > 0) w.maxModelLen = len as number;
  w.push = pushFields(h);
  // Only a nixl-node answer (it names its model) says whether it publishes: vLLM's /health says nothing.
  if (typeof h?.model === 'string') w.kvEvents = kvEventsFields(h.kv_events);
}

/** Where a worker's health answer says it publishes KV events; undefined when it does not say so well. */
function kvEventsFields(x: unknown): WorkerRef['kvEvents'] {
  if (x === undefined) return undefined;
  const k = parseKvEvents(x);
  return typeof k === 'string' ? undefined : k;
}

/** The names a health answer lists (served_model_names), model first; undefined when it lists none that fit. */
function servedNames(h: Record<string, unknown> | undefined, model: string | undefined): string[] | undefined {
  const names = h?.served_model_names;
  if (model === undefined || !Array.isArray(names) || names.length > 64) return undefined;
  const ok = names.filter((n): n is string => typeof n === 'string' && n.length > 0 && n.length <= 256);
  return [...new Set([model, ...ok])];
}

/** A push worker's KV coordinates from its health answer, or undefined. */
function pushFields(h: Record<string, unknown> | undefined): WorkerRef['push'] {
  if (h?.kv_mode !== 'push') return undefined;
  const { kv_engine_id: engineId, kv_host: host, kv_port: port, tp_size: tpSize, pp_size: ppSize } = h;
  const int = (v: unknown, max: number) => Number.isSafeInteger(v) && (v as number) >= 1 && (v as number) <= max;
  if (typeof engineId !== 'string' || engineId.length > 256 || typeof host !== 'string' || host.length > 256)
    return undefined;
  if (!int(port, 65535) || !int(tpSize, 1024) || !int(ppSize, 64)) return undefined;
  return { engineId, host, port: port as number, tpSize: tpSize as number, ppSize: ppSize as number };
}
