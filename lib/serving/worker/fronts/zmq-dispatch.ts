// What a ZeroMQ worker does with each message it receives (docs/serving-zmq.md):
// it reads the frames, checks every field it uses, and answers or drops. The
// PULL socket takes messages from whoever can reach it, so nothing here
// trusts a field: a message it cannot read at all is dropped and counted
// (stats.messagesDropped); one that names a usable reply_to but is malformed
// gets a FAILURE with status 400 and a code; none of them throws.
import { serveRoute } from './generate-route';
import { TAGS, type Tag, type ZmqReply, unpackMap } from '../../api/zmq-protocol';
import type { FrontHandler } from './front';

export type ReplyTag = 'ENCODE' | 'GENERATION' | 'FAILURE' | 'HEALTH';
/**
 * Sends one answer to a reply_to address; never throws. It may say whether
 * the answer went out (false: dropped), and is given `skip`, asked just before
 * the send, for answers queued behind one that was dropped.
 */
export type ReplyFn = (
  to: string,
  tag: ReplyTag,
  r: ZmqReply,
  skip?: () => boolean,
) => boolean | undefined | Promise<boolean | undefined>;

/** The codes of a FAILURE for a message the worker could read but not use. */
export const MESSAGE_ERRORS = {
  invalid: 'invalid_message',
  duplicate: 'duplicate_msg_id',
  /** An answer of the call could not be sent (the reply socket's queue was full, or a send timed out). */
  dropped: 'reply_dropped',
} as const;

/** Longest msg_id, request_id and path a worker takes. */
const MAX_ID = 256;

function str(v: unknown, max: number): v is string {
  return typeof v === 'string' && v.length > 0 && v.length <= max;
}

export class ZmqDispatch {
  readonly #w: FrontHandler;
  readonly #reply: ReplyFn;
  /** Calls in flight by msg_id: an ABORT names one. */
  readonly #aborts = new Map<string, AbortController>();

  constructor(w: FrontHandler, reply: ReplyFn) {
    this.#w = w;
    this.#reply = reply;
  }

  /** ENCODE and GENERATION calls being served now. */
  get inFlight(): number {
    return this.#aborts.size;
  }

  /** One message off the PULL socket. */
  onMessage(frames: Buffer[]) {
    const drop = () => void this.#w.stats.messagesDropped++;
    if (frames.length !== 2) return drop();
    const body = unpackMap(frames[1]);
    if (!body) return drop();
    const tag = frames[0].toString('latin1');
    // An address no socket can use is dropped and counted where the answer goes out (zmq-replies.ts).
    const replyTo = typeof body.reply_to === 'string' ? body.reply_to : undefined;
    const msgId = body.msg_id;
    const refuse = (message: string, code: string = MESSAGE_ERRORS.invalid) => {
      if (replyTo === undefined) return drop();
      this.#reply(replyTo, 'FAILURE', {
        msg_id: typeof msgId === 'string' ? msgId.slice(0, MAX_ID) : '',
        status: 400,
        error: { message, code },
      });
    };
    if (!(TAGS as readonly string[]).includes(tag)) return refuse(`unknown tag ${JSON.stringify(tag.slice(0, 20))}`);
    if (!str(msgId, MAX_ID)) return refuse(`msg_id must be a string of 1 to ${MAX_ID} characters`);
    switch (tag as Tag) {
      case 'ABORT':
        this.#aborts.get(msgId)?.abort();
        return;
      case 'RELEASE':
        // No answer: a field that is not an id releases nothing.
        try {
          if (body.remote_request_id === undefined) this.#w.releaseRequest(body.request_id);
          else this.#w.releaseHold(body.remote_request_id);
        } catch {
          /* not an id */
        }
        return;
      case 'HEALTH':
        if (replyTo === undefined) return drop();
        this.#reply(replyTo, 'HEALTH', { msg_id: msgId, ok: !this.#w.unhealthy(), ...this.#w.healthInfo() });
        return;
      case 'ENCODE':
      case 'GENERATION':
        return this.#call(tag as 'ENCODE' | 'GENERATION', msgId, replyTo, body, refuse);
      default:
        // FAILURE is an answer, not a request.
        return refuse(`${tag} is not a request`);
    }
  }

  #call(
    tag: 'ENCODE' | 'GENERATION',
    msgId: string,
    replyTo: string | undefined,
    b: Record<string, unknown>,
    refuse: (message: string, code?: string) => void,
  ) {
    if (replyTo === undefined) return void this.#w.stats.messagesDropped++;
    if (b.path !== undefined && !str(b.path, MAX_ID)) return refuse('path must be a string');
    if (b.request_id !== undefined && !str(b.request_id, MAX_ID))
      return refuse(`request_id must be a string of 1 to ${MAX_ID} characters`);
    if (typeof b.payload !== 'object' || b.payload === null || Array.isArray(b.payload))
      return refuse('payload must be a map');
    // Two calls with one msg_id could not be told apart in the answers, nor aborted one by one.
    if (this.#aborts.has(msgId)) return refuse(`msg_id ${msgId} is in flight`, MESSAGE_ERRORS.duplicate);
    const ac = new AbortController();
    this.#aborts.set(msgId, ac);
    // A chunk that could not be sent leaves a gap the proxy cannot see:
    // everything of the call after it is withheld, the call aborted, and a
    // FAILURE sent instead, so the proxy fails the call rather than answer
    // with a hole (an end that could not be sent: the proxy times it out).
    let lost = false;
    let failed = false;
    const fail = (status: number, error: { message: string; code: string } & Record<string, unknown>) => {
      if (failed) return;
      failed = true;
      void this.#reply(replyTo, 'FAILURE', { msg_id: msgId, status, error });
    };
    const onLost = (chunk: boolean) => {
      if (lost) return;
      lost = true;
      ac.abort();
      if (chunk)
        fail(503, {
          message: `an answer to ${replyTo} could not be sent; the call is failed`,
          code: MESSAGE_ERRORS.dropped,
        });
    };
    const reply = (r: ZmqReply) => {
      if (lost) return;
      void Promise.resolve(this.#reply(replyTo, tag, r, () => lost)).then((ok) => {
        if (ok === false) onLost(r.done === false);
      });
    };
    void (async () => {
      try {
        await serveRoute(this.#w, {
          path: (b.path as string | undefined) ?? '/v1/completions',
          body: b.payload as Record<string, unknown>,
          requestId: (b.request_id as string | undefined) ?? msgId,
          signal: ac.signal,
          sink: {
            chunk: (c) => reply({ msg_id: msgId, chunk: c, done: false }),
            end: (status, body) => reply({ msg_id: msgId, status, payload: body, done: true }),
          },
          traceparent: b.traceparent,
          hints: { decodeMaxTokens: b.decode_max_tokens },
        });
      } catch (e) {
        const h = this.#w.failed(e);
        if (!lost) fail(h.status, { message: h.message, code: h.code, ...h.details });
      } finally {
        this.#aborts.delete(msgId);
      }
    })();
  }

  /** Aborts every call in flight (the worker is closing). */
  abortAll(): void {
    for (const a of this.#aborts.values()) a.abort();
  }
}
