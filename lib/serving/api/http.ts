// HTTP pieces the proxy and the workers share: the error a handler throws
// (status + OpenAI error type) and a bounded JSON body reader (the OpenAI
// bodies are in openai.ts).
import type * as http from 'node:http';

/** A request that ends in this status with an OpenAI-style error body. */
export class HttpError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly code = 'invalid_request_error',
    /** More fields of the error body (a KV refusal's reason and NixlError code). */
    readonly details?: Record<string, unknown>,
  ) {
    super(message);
    this.name = 'HttpError';
  }
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

/** Image parts in a chat request's messages (0 for a completion request). */
export function countImages(body: Record<string, unknown>): number {
  if (!Array.isArray(body.messages)) return 0;
  let n = 0;
  for (const m of body.messages as Array<{ content?: unknown }>)
    if (Array.isArray(m?.content)) for (const p of m.content) if ((p as { type?: string })?.type === 'image_url') n++;
  return n;
}

export function hasImages(body: Record<string, unknown>): boolean {
  return countImages(body) > 0;
}
