// How the proxy reaches a worker for one stage, whatever the wire: HTTP
// (http.ts: real vLLM OpenAI servers, or Node workers) or ZeroMQ (zmq.ts).
// Both give back the status and JSON of an answer, or its stream of chunks,
// and both honour an AbortSignal (client gone, or the stage timed out).
import type { Stage, WorkerRef } from '../pool';

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

/** What a health check found. */
export interface HealthResult {
  ok: boolean;
  /** Why not, when not ok. */
  cause?: string;
}
