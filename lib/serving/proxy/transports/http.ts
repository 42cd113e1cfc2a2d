// The proxy's HTTP transport: workers as OpenAI HTTP servers (vLLM's, or
// nixl-node's), an SSE stream read back as chunks.
import { Agent, type Dispatcher } from 'undici';
import type { WorkerRef } from '../pool';
import { causeOf, healthFields, parseObject, reasonOf } from './health';
import { type HealthResult, type StageAnswer, type StageCall, TransportError, type WorkerTransport } from './types';

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
