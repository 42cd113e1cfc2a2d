// The proxy's ZeroMQ transport (docs/serving-zmq.md): a PUSH socket to
// each worker, one PULL bound here for every reply, matched by msg_id.
import { randomUUID } from 'node:crypto';
import * as zmq from 'zeromq';
import { SerialSender, decodeMessage, encodeMessage, type Tag } from '../../api/zmq-protocol';
import { receiveLoop } from '../../api/zmq-receive';
import type { WorkerRef } from '../pool';
import { causeOf, healthFields, reasonOf } from './health';
import { type HealthResult, type StageAnswer, type StageCall, TransportError, type WorkerTransport } from './types';

interface Pending {
  push(tag: Tag, body: Record<string, unknown>): void;
  fail(e: Error): void;
}

type Reply = { tag: Tag; body: Record<string, unknown> };

/** One call's replies: they arrive in order on one socket, and a queue hands them to the reader. */
class Replies implements Pending {
  readonly #queue: Reply[] = [];
  #wake?: () => void;
  #failure?: Error;

  push(tag: Tag, body: Record<string, unknown>): void {
    this.#queue.push({ tag, body });
    this.#wake?.();
  }

  fail(e: Error): void {
    this.#failure = e;
    this.#wake?.();
  }

  /** The next reply; throws once failed (aborted, or the transport closed) with none left. */
  async next(): Promise<Reply> {
    while (this.#queue.length === 0) {
      if (this.#failure) throw this.#failure;
      await new Promise<void>((r) => (this.#wake = r));
      this.#wake = undefined;
    }
    return this.#queue.shift()!;
  }
}

/** A whole reply (or a failure) as a stage's answer. */
function answerOf(m: Reply): StageAnswer {
  return m.tag === 'FAILURE'
    ? { status: Number(m.body.status ?? 500), json: { error: m.body.error } }
    : { status: Number(m.body.status ?? 200), json: m.body.payload as Record<string, unknown> };
}

/** A streamed reply's chunks, from its first message to the one that says done; `done` once it ends. */
async function* streamOf(first: Reply, replies: Replies, done: () => void): AsyncIterable<Record<string, unknown>> {
  try {
    for (let m = first; ; m = await replies.next()) {
      if (m.tag === 'FAILURE') throw new TransportError(`worker failed mid-stream: ${JSON.stringify(m.body.error)}`);
      if (m.body.chunk) yield m.body.chunk as Record<string, unknown>;
      if (m.body.done !== false) return;
    }
  } finally {
    done();
  }
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
    void receiveLoop(this.#pull, (frames) => this.#onReply(frames));
    return this;
  }

  #onReply(frames: Buffer[]): void {
    try {
      const { tag, body } = decodeMessage(frames);
      this.#pending.get(body.msg_id as string)?.push(tag, body);
    } catch {
      this.repliesDropped++; // garbage from a worker (or whoever reached this socket)
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
    const replies = new Replies();
    this.#pending.set(msgId, replies);
    const onAbort = () => {
      replies.fail(new TransportError(`${c.worker.address}: aborted`, true));
      void this.#send(c.worker.address, 'ABORT', { msg_id: msgId }).catch(() => {});
    };
    c.signal.addEventListener('abort', onAbort, { once: true });
    const done = () => {
      c.signal.removeEventListener('abort', onAbort);
      this.#pending.delete(msgId);
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
      const first = await replies.next();
      if (first.body.done !== false) {
        done();
        return answerOf(first);
      }
      return { status: 200, chunks: streamOf(first, replies, done) };
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
