// The request bodies of /v1/completions and /v1/chat/completions, checked
// once for the proxy and the workers: a client's mistake is a 400 naming the
// field wherever it lands, never a TypeError inside a worker (a 5xx, which the
// proxy reads as the worker being sick and takes it out of the pool). The
// 400 says which field (OpenAI's `param`).
import { HttpError } from './http';
import { unsupportedField } from './unsupported';

export class RequestError extends HttpError {
  constructor(
    status: number,
    message: string,
    /** The field at fault (OpenAI's error.param). */
    readonly param?: string,
    /** OpenAI's error.code: unsupported_parameter for a field not served. */
    code?: string,
  ) {
    super(status, message, 'invalid_request_error', {
      ...(param !== undefined ? { param } : {}),
      ...(code !== undefined ? { code } : {}),
    });
    this.name = 'RequestError';
  }
}

const bad = (m: string, param?: string): never => {
  throw new RequestError(400, m, param);
};

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

function optional(b: Record<string, unknown>, key: string, ok: (v: unknown) => boolean, what: string): void {
  if (b[key] !== undefined && !ok(b[key])) bad(`'${key}' must be ${what}`, key);
}

const posInt = (max: number) => (v: unknown) => Number.isInteger(v) && (v as number) >= 1 && (v as number) <= max;

/** One chat message: a role and content as a string or a list of text / image_url parts. */
function checkMessage(m: unknown, i: number): void {
  const where = `messages[${i}]`;
  if (!isObject(m)) bad(`${where} must be an object`, where);
  const msg = m as Record<string, unknown>;
  if (typeof msg.role !== 'string' || msg.role.length === 0)
    bad(`${where}.role must be a non-empty string`, `${where}.role`);
  const c = msg.content;
  if (typeof c === 'string') return;
  if (!Array.isArray(c)) bad(`${where}.content must be a string or an array of content parts`, `${where}.content`);
  (c as unknown[]).forEach((p, j) => {
    const part = `${where}.content[${j}]`;
    if (!isObject(p)) bad(`${part} must be an object`, part);
    const q = p as Record<string, unknown>;
    if (q.type === 'text') {
      if (typeof q.text !== 'string') bad(`${part}.text must be a string`, `${part}.text`);
    } else if (q.type === 'image_url') {
      if (!isObject(q.image_url) || typeof q.image_url.url !== 'string')
        bad(`${part}.image_url.url must be a string`, `${part}.image_url.url`);
    } else bad(`${part}.type must be 'text' or 'image_url'`, `${part}.type`);
  });
}

export interface CheckOptions {
  /** Workers take kv_transfer_params (from the proxy); the proxy refuses them from clients. */
  kvTransferParams: 'refuse' | 'object';
}

/** Throws RequestError (400) naming the first field that is wrong. */
export function checkCompletionRequest(path: string, b: Record<string, unknown>, o: CheckOptions): void {
  optional(b, 'model', (v) => typeof v === 'string', 'a string');
  if (path === '/v1/chat/completions') {
    if (!Array.isArray(b.messages) || b.messages.length === 0) bad("'messages' must be a non-empty array", 'messages');
    (b.messages as unknown[]).forEach(checkMessage);
  } else if (typeof b.prompt !== 'string') bad("'prompt' must be a string", 'prompt');
  for (const k of ['max_tokens', 'max_completion_tokens']) optional(b, k, posInt(1 << 20), 'a positive integer');
  // One choice per request: n > 1 is not served, and silently answering one choice would lie.
  optional(b, 'n', (v) => v === null || v === 1, '1 (one choice per request is served)');
  optional(b, 'stream', (v) => typeof v === 'boolean', 'a boolean');
  optional(b, 'stream_options', (v) => v === null || isObject(v), 'an object');
  optional(b, 'temperature', (v) => typeof v === 'number' && v >= 0 && v <= 2, 'a number from 0 to 2');
  optional(b, 'top_p', (v) => typeof v === 'number' && v > 0 && v <= 1, 'a number in (0, 1]');
  optional(b, 'seed', (v) => Number.isSafeInteger(v), 'an integer');
  optional(
    b,
    'stop',
    (v) =>
      v === null ||
      typeof v === 'string' ||
      (Array.isArray(v) && v.length <= 16 && v.every((s) => typeof s === 'string')),
    'a string or an array of at most 16 strings',
  );
  if (b.kv_transfer_params !== undefined) {
    if (o.kvTransferParams === 'refuse')
      bad("'kv_transfer_params' is set by the proxy, not by clients", 'kv_transfer_params');
    if (!isObject(b.kv_transfer_params)) bad("'kv_transfer_params' must be an object", 'kv_transfer_params');
  }
  const u = unsupportedField(b);
  if (u) throw new RequestError(400, u.message, u.param, 'unsupported_parameter');
}
