// What a worker's fronts (HTTP, ZeroMQ) need of the worker behind them: they
// depend on this, not on Worker, so the worker imports its fronts and
// nothing imports it back.
import type { HttpError } from '../../api/http';
import type { ServingModel } from '../../models/types';

/** Where a front takes a worker's answer: streamed chunks, then the end. */
export type Sink = {
  /** Streamed: one OpenAI chunk. */
  chunk(c: Record<string, unknown>): void;
  /** The whole answer (not streamed), or the end of a stream. */
  end(status: number, body?: Record<string, unknown>): void;
  /** A piece of the answer's text was made, streamed or not (the metrics time tokens by it). */
  token?(): void;
};

/** What a request's front passes besides its body. */
export interface RequestHints {
  /** Prefill: the max_tokens its decode will generate (a header or message field: checked here). */
  decodeMaxTokens?: unknown;
}

/** One request as a front passes it to the worker. */
export interface WorkerRequest {
  /** The route: /v1/completions, /v1/chat/completions. */
  path: string;
  body: Record<string, unknown>;
  /** The request's id (X-Request-Id, the ZeroMQ request_id, or one made up). */
  requestId: string;
  /** Aborted when the client goes away. */
  signal: AbortSignal;
  /** Where the answer goes. */
  sink: Sink;
  /** The proxy's W3C traceparent: the worker's span is a child of its stage span. */
  traceparent?: unknown;
  hints?: RequestHints;
}

/** The worker as its fronts (HTTP, ZeroMQ) see it. */
export interface FrontHandler {
  readonly name: string;
  /** The model's name in answers and /v1/models. */
  readonly modelId: string;
  /** The model's tokenizer, for requests in token ids (vLLM's generate endpoint). */
  readonly model: Pick<ServingModel, 'tokenizer' | 'promptTokenIds'>;
  /** KV blocks free right now. */
  readonly freeBlocks: number;
  /** What its health answers carry besides the status: name, model, context size, free blocks, requests waiting for blocks. */
  healthInfo(): {
    name: string;
    model: string;
    max_model_len?: number;
    free_blocks: number;
    num_requests_waiting: number;
    /** Every name it serves (vLLM --served-model-name): the proxy routes a request for any of them here. */
    served_model_names?: string[];
    /** Where its metrics listener serves /metrics and /health, when it has one (--metrics-port). */
    metrics_url?: string;
  };
  /** Why the worker cannot serve right now (its model cannot make a context), or undefined. */
  unhealthy(): string | undefined;
  /** Counters the fronts add to. */
  readonly stats: { repliesDropped: number; messagesDropped: number };
  /** Frees the blocks a prefilled request holds (the proxy says its decode will not read them). */
  releaseHold(remoteRequestId: unknown): boolean;
  /** Frees the holds of a request by the proxy's request id (its prefill answer may not have arrived). */
  releaseRequest(requestId: unknown): number;
  /** One request, answered into `sink`. Throws HttpError. */
  handle(r: WorkerRequest): Promise<void>;
  /** Counts a failed request; the error as the front answers it. */
  failed(e: unknown): HttpError;
  /** GET /metrics: Prometheus text; undefined without prom-client. */
  readonly metrics?: {
    /** The exposition text and its content type. */
    scrape(): Promise<{ contentType: string; text: string }>;
  };
  /** Every name it serves under (vLLM --served-model-name); modelId is the first. */
  readonly servedModelNames?: readonly string[];
}
