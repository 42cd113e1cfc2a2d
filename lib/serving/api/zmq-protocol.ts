// The ZeroMQ worker protocol of the serving proxy (docs/serving-zmq.md), as
// in vLLM's ZeroMQ encode/prefill/decode proxy: PUSH sockets from the proxy
// to each worker, one PULL socket for every worker's replies. Each message is
// two frames: an ASCII tag and a msgpack map.
//   proxy -> worker  ENCODE | GENERATION  {msg_id, request_id, path, reply_to, payload, traceparent?, decode_max_tokens?}
//                    ABORT                {msg_id}
//                    RELEASE              {msg_id, remote_request_id}   (a prefill frees that hold now)
//                                         {msg_id, request_id}          (... every hold and prefill of that request)
//                    HEALTH               {msg_id, reply_to}
//   worker -> proxy  ENCODE               {msg_id, status, payload}
//                    GENERATION           {msg_id, status, payload, done: true}      (not streamed)
//                                         {msg_id, chunk, done: false} ... {msg_id, done: true}  (streamed)
//                    FAILURE              {msg_id, status, error: {message, code}}
//                    HEALTH               {msg_id, ok, name, model?, max_model_len?, free_blocks?}
import { Packr } from 'msgpackr';

/** The message tags of the ZeroMQ worker protocol. */
export const TAGS = ['ENCODE', 'GENERATION', 'FAILURE', 'ABORT', 'HEALTH', 'RELEASE'] as const;
/** A message tag. */
export type Tag = (typeof TAGS)[number];

/** A message from the proxy to a worker. */
export interface ZmqRequest {
  msg_id: string;
  request_id?: string;
  remote_request_id?: string;
  /** W3C trace context of the proxy's stage span. */
  traceparent?: string;
  path?: string;
  reply_to?: string;
  payload?: Record<string, unknown>;
  /** GENERATION to a prefill: the max_tokens its decode will generate (checked against the context first). */
  decode_max_tokens?: number;
}

/** A message from a worker to the proxy. */
export interface ZmqReply {
  msg_id: string;
  status?: number;
  payload?: Record<string, unknown>;
  chunk?: Record<string, unknown>;
  done?: boolean;
  error?: { message: string; code?: string };
  ok?: boolean;
  name?: string;
  /** HEALTH: the model the worker serves (its /v1/models id). */
  model?: string;
  /** HEALTH: tokens of the model's context, when bounded. */
  max_model_len?: number;
  /** HEALTH: KV blocks free. */
  free_blocks?: number;
}

// Plain maps and arrays only (no msgpackr records or extensions), so any msgpack peer reads them.
const packr = new Packr({ useRecords: false, mapsAsObjects: true, variableMapSize: true });

/** A message as its two frames: the tag, and a msgpack map. */
export function encodeMessage(tag: Tag, body: ZmqRequest | ZmqReply): [Buffer, Buffer] {
  return [Buffer.from(tag, 'ascii'), packr.pack(body)];
}

/** A msgpack map, or undefined for anything else (bytes msgpack cannot read, an array, a scalar). */
export function unpackMap(frame: Buffer): Record<string, unknown> | undefined {
  let v: unknown;
  try {
    v = packr.unpack(frame);
  } catch {
    return undefined;
  }
  return typeof v === 'object' && v !== null && !Array.isArray(v) && !Buffer.isBuffer(v)
    ? (v as Record<string, unknown>)
    : undefined;
}

/** Reads a two-frame message; anything else is an Error with a message. */
export function decodeMessage(frames: Buffer[]): { tag: Tag; body: Record<string, unknown> } {
  if (frames.length !== 2) throw new Error(`expected 2 frames (tag, msgpack map), got ${frames.length}`);
  const tag = frames[0].toString('ascii');
  if (!(TAGS as readonly string[]).includes(tag)) throw new Error(`unknown tag ${JSON.stringify(tag.slice(0, 20))}`);
  const body = packr.unpack(frames[1]) as unknown;
  if (typeof body !== 'object' || body === null || Array.isArray(body)) throw new Error('the body is not a map');
  const b = body as Record<string, unknown>;
  if (typeof b.msg_id !== 'string' || b.msg_id.length === 0 || b.msg_id.length > 256)
    throw new Error('msg_id must be a non-empty string');
  return { tag: tag as Tag, body: b };
}

/**
 * A zeromq.js socket takes one send at a time ("Socket is busy writing"):
 * sends through this wait their turn, in order.
 */
export class SerialSender {
  #tail: Promise<unknown> = Promise.resolve();

  constructor(readonly socket: { send(frames: Buffer[]): Promise<void>; close(): void }) {}

  /** Sends after the sends before it; `skip`, asked then, withholds this one (it rejects). */
  send(frames: Buffer[], skip?: () => boolean): Promise<void> {
    const p = this.#tail.then(() => (skip?.() ? Promise.reject(new Error('withheld')) : this.socket.send(frames)));
    this.#tail = p.catch(() => {});
    return p;
  }
}
