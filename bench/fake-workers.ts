// Fake vLLM prefill and decode workers for measuring a proxy alone: they
// speak /v1/completions with kv_transfer_params as vLLM's NixlConnector does
// (the prefill answers one token and the params of its KV, the decode takes
// them back), over this project's HTTP and ZeroMQ fronts, and do no model
// work, so what a load measures is the proxy. Nothing moves: the prefill's
// remote_request_id names a digest of the prompt, the decode refuses params
// that do not match its prompt, and answers a text made from the prompt, so
// the client checks every answer (a mixed-up pairing or body fails it).
//
// Run as a script (node dist/bench/fake-workers.js prefill|decode) it prints
// one JSON line {url, zmq} when ready and serves until killed.
import { createHash, randomUUID } from 'node:crypto';
import type * as http from 'node:http';
import { buildKvTransferParams } from '../lib/handshake/wire';
import type { FrontHandler, WorkerRequest } from '../lib/serving/worker/fronts/front';
import { HttpError } from '../lib/serving/api/http';
import { serveHttp } from '../lib/serving/worker/fronts/http';
import { ZmqFront } from '../lib/serving/worker/fronts/zmq';

export const FAKE_MODEL = 'fake-vllm';

function digest(prompt: string): string {
  return createHash('sha1').update(prompt).digest('hex').slice(0, 16);
}

/** The text the fake decode answers for a prompt (what a client checks). */
export function expectedText(prompt: string): string {
  return ` decoded ${digest(prompt)}`;
}

/** Why a proxy's answer to `prompt` is not the fake decode's, or undefined when it is. */
export function wrongAnswer(prompt: string, status: number, body: string): string | undefined {
  if (status !== 200) return `HTTP ${status}: ${body.slice(0, 200)}`;
  let j: { choices?: Array<{ text?: unknown }>; model?: unknown };
  try {
    j = JSON.parse(body);
  } catch {
    return `not JSON: ${body.slice(0, 200)}`;
  }
  const text = j.choices?.[0]?.text;
  if (text !== expectedText(prompt)) return `wrong text ${JSON.stringify(text)} for ${JSON.stringify(prompt)}`;
  return undefined;
}

type Obj = Record<string, unknown>;

class FakeWorker implements FrontHandler {
  readonly modelId = FAKE_MODEL;
  readonly model = { tokenizer: undefined as never };
  readonly freeBlocks = 1 << 20;
  readonly stats = { repliesDropped: 0, messagesDropped: 0, served: 0, refused: 0 };
  constructor(readonly name: 'prefill' | 'decode') {}

  healthInfo() {
    return { name: this.name, model: FAKE_MODEL, free_blocks: this.freeBlocks, num_requests_waiting: 0 };
  }
  unhealthy(): string | undefined {
    return undefined;
  }
  releaseHold(): boolean {
    return true;
  }
  releaseRequest(): number {
    return 0;
  }
  failed(e: unknown): HttpError {
    this.stats.refused++;
    return e instanceof HttpError ? e : new HttpError(500, (e as Error).message, 'internal_error');
  }

  async handle({ path, body, requestId, sink }: WorkerRequest): Promise<void> {
    if (path !== '/v1/completions') throw new HttpError(404, `fake workers serve /v1/completions, not ${path}`);
    const prompt = body.prompt;
    if (typeof prompt !== 'string') throw new HttpError(400, 'prompt must be a string');
    const kv = body.kv_transfer_params as Obj | undefined;
    const d = digest(prompt);
    const answer = (text: string, extra: Obj) => ({
      id: `cmpl-${requestId}`,
      object: 'text_completion',
      created: 0,
      model: FAKE_MODEL,
      choices: [{ index: 0, text, finish_reason: 'length', logprobs: null }],
      usage: { prompt_tokens: prompt.length, completion_tokens: 1, total_tokens: prompt.length + 1 },
      ...extra,
    });
    if (this.name === 'prefill') {
      if (kv?.do_remote_decode !== true || body.max_tokens !== 1 || body.stream === true)
        throw new HttpError(400, 'a prefill takes do_remote_decode, max_tokens 1, not streamed');
      this.stats.served++;
      const params = buildKvTransferParams({
        remoteEngineId: 'fake-prefill',
        remoteRequestId: `${d}-${randomUUID()}`,
        remoteBlockIds: [[1, 2, 3]],
        remoteHost: '127.0.0.1',
        remotePort: 5600,
        tpSize: 1,
      });
      return sink.end(200, answer(' ', { kv_transfer_params: params }));
    }
    const rid = kv?.remote_request_id;
    if (kv?.do_remote_prefill !== true || typeof rid !== 'string' || !rid.startsWith(`${d}-`))
      throw new HttpError(400, `kv_transfer_params are not the prefill's for this prompt: ${JSON.stringify(kv)}`);
    this.stats.served++;
    sink.end(200, answer(expectedText(prompt), {}));
  }
}

export interface FakeWorkerServer {
  url: string;
  zmq: string;
  stats: FakeWorker['stats'];
  close(): Promise<void>;
}

/** One fake worker, on an HTTP port and a ZeroMQ PULL address of 127.0.0.1. */
export async function startFakeWorker(role: 'prefill' | 'decode'): Promise<FakeWorkerServer> {
  const w = new FakeWorker(role);
  const { server, url } = await serveHttp(w, {
    host: '127.0.0.1',
    port: 0,
    maxBodyBytes: 1 << 20,
    requestTimeoutMs: 30_000,
  });
  server.keepAliveTimeout = 60_000;
  const front = await ZmqFront.bind(w, 'tcp://127.0.0.1:*', 1 << 20);
  return {
    url,
    zmq: front.address,
    stats: w.stats,
    close: async () => {
      front.close();
      (server as http.Server).closeAllConnections();
      await new Promise((r) => server.close(r));
    },
  };
}

if (require.main === module) {
  const role = process.argv[2];
  if (role !== 'prefill' && role !== 'decode') {
    console.error('usage: fake-workers.js prefill|decode');
    process.exit(2);
  }
  void startFakeWorker(role).then((s) => {
    console.log(JSON.stringify({ ready: true, url: s.url, zmq: s.zmq }));
    process.on('SIGTERM', () => void s.close().then(() => process.exit(0)));
  });
}
