// A worker's ZeroMQ front (docs/serving-zmq.md): one PULL socket for the
// proxy's requests, a PUSH socket per proxy for the answers.
import * as zmq from 'zeromq';
import { serveRoute } from './generate';
import { HttpError } from './http';
import { decodeMessage, encodeMessage, type ZmqReply } from './protocol';
import type { FrontHandler } from './front';
import { ReplySockets } from './zmq-replies';

type ReplyTag = 'ENCODE' | 'GENERATION' | 'FAILURE' | 'HEALTH';

export class ZmqFront {
  readonly #w: FrontHandler;
  readonly #pull: zmq.Pull;
  readonly #replies: ReplySockets;
  readonly #aborts = new Map<string, AbortController>();
  #closed = false;

  private constructor(w: FrontHandler, pull: zmq.Pull) {
    this.#w = w;
    this.#pull = pull;
    this.#replies = new ReplySockets(64, () => w.stats.repliesDropped++);
  }

  /** Reply sockets open now (one per proxy answered lately, at most 64). */
  get replySockets(): number {
    return this.#replies.size;
  }

  /** Binds addr (tcp://host:port, tcp://host:* for any port, ipc://path) and serves. */
  static async bind(w: FrontHandler, addr: string, maxBodyBytes: number): Promise<ZmqFront> {
    const pull = new zmq.Pull({ linger: 0, maxMessageSize: maxBodyBytes });
    await pull.bind(addr);
    const f = new ZmqFront(w, pull);
    void f.#loop();
    return f;
  }

  get address(): string {
    return this.#pull.lastEndpoint!;
  }

  async #loop(): Promise<void> {
    for (;;) {
      let frames: Buffer[];
      try {
        frames = await this.#pull.receive();
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
        traceparent?: unknown;
        remote_request_id?: unknown;
        decode_max_tokens?: unknown;
      };
      if (msg.tag === 'ABORT') {
        this.#aborts.get(b.msg_id)?.abort();
        continue;
      }
      if (msg.tag === 'RELEASE') {
        try {
          if (b.remote_request_id === undefined) this.#w.releaseRequest(b.request_id);
          else this.#w.releaseHold(b.remote_request_id);
        } catch {
          /* not a string: nothing to release */
        }
        continue;
      }
      if (typeof b.reply_to !== 'string') continue;
      const replyTo = b.reply_to;
      const reply = (tag: ReplyTag, r: ZmqReply) => this.#reply(replyTo, tag, r);
      if (msg.tag === 'HEALTH') {
        void reply('HEALTH', { msg_id: b.msg_id, ok: !this.#w.unhealthy(), ...this.#w.healthInfo() });
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
          await serveRoute(
            this.#w,
            String(b.path ?? '/v1/completions'),
            b.payload as Record<string, unknown>,
            String(b.request_id ?? b.msg_id),
            ac.signal,
            {
              chunk: (c) => void reply(tag, { msg_id: b.msg_id, chunk: c, done: false }),
              end: (status, body) => void reply(tag, { msg_id: b.msg_id, status, payload: body, done: true }),
            },
            b.traceparent,
            { decodeMaxTokens: b.decode_max_tokens },
          );
        } catch (e) {
          const h = this.#w.failed(e);
          void reply('FAILURE', {
            msg_id: b.msg_id,
            status: h.status,
            error: { message: h.message, code: h.code, ...h.details },
          });
        } finally {
          this.#aborts.delete(b.msg_id);
        }
      })();
    }
  }

  #reply(to: string, tag: ReplyTag, r: ZmqReply): Promise<void> {
    if (this.#closed) return Promise.resolve();
    return this.#replies.send(to, encodeMessage(tag, r));
  }

  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    for (const a of this.#aborts.values()) a.abort();
    this.#pull.close();
    this.#replies.close();
  }
}
