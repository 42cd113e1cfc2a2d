// A GGUF model through node-llama-cpp (llama.cpp), behind the ServingModel
// boundary. node-llama-cpp is an optional peer dependency, imported only
// here, when a worker is given a GGUF.
//
// prefill  runs node-llama-cpp's own LlamaCompletion (or LlamaChatSession,
//          through the model's chat template) until the sequence has sampled
//          its first token, saves the sequence state (exactly the prompt)
//          and wraps it with that token (kv-state.ts) into the request's
//          blocks;
// decode   checks the envelope (model, build, size, checksum, token count),
//          loads the state into a fresh sequence and runs the same class
//          again on a view that continues from the first token
//          (llama-continue.ts): every number and every rule is the class's.
// Each request has a context of its own (a pool of `parallel` contexts, one
// sequence each, cleared between requests), so that nothing another request
// evaluates changes this one's numbers.
import { createHash, randomInt, randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
// Types only (erased): the declarations this file emits name none of them, so
// an application without node-llama-cpp still type-checks against the package.
import type * as Nlc from 'node-llama-cpp';
import { NixlError } from '../../errors';
import { FirstTokenSampled, continueFrom, firstTokenOf } from './llama-continue';
import { WholeText } from './llama-text';
import { loadNodeLlamaCpp } from './node-llama-cpp';
import { makeStateDir } from './state-dir';
import { NODE_LLAMA_CPP } from './types';
import { HEADER_BYTES, envelopeBytes, openEnvelope, stateHeader, writeEnvelope } from './kv-state';
import {
  type BlockView,
  type ChatMessage,
  type Generated,
  type GenerationRequest,
  type KvGeometry,
  ModelRequestError,
  type PrefilledKv,
  type ServingModel,
  type TextSink,
} from './types';

/** Options of a LlamaModel. */
export interface LlamaModelOptions {
  /** A GGUF file. */
  modelPath: string;
  /** CPU threads of each context (default: the cores, shared among `parallel` contexts). */
  threads?: number;
  /** Tokens of each context (default 4096, at most the model's trained length). */
  contextSize?: number;
  /** Requests evaluated at once, one context each (default 2). */
  parallel?: number;
  /** Bytes of one KV block of the worker's pool. */
  blockBytes: number;
  /** Bytes of the whole pool: the largest state a decode takes. */
  poolBytes: number;
  /** node-llama-cpp's GPU backend (default false: CPU). */
  gpu?: false | 'auto';
  /**
   * Where states go through files on their way in and out of llama.cpp
   * (default: NIXL_NODE_STATE_DIR, else /dev/shm where it is a writable
   * memory file system, else the OS temp dir).
   */
  stateDir?: string;
}

/** At most `max` contexts, made on demand: a request waits for a free one. */
class ContextPool {
  readonly #free: Nlc.LlamaContext[] = [];
  readonly #waiters: Array<(c: Nlc.LlamaContext) => void> = [];
  #created = 0;
  readonly all: Nlc.LlamaContext[] = [];

  constructor(
    readonly max: number,
    readonly create: () => Promise<Nlc.LlamaContext>,
  ) {}

  async acquire(signal: AbortSignal): Promise<Nlc.LlamaContext> {
    const c = this.#free.pop();
    if (c) return c;
    if (this.#created < this.max) {
      this.#created++;
      try {
        const ctx = await this.create();
        this.all.push(ctx);
        return ctx;
      } catch (e) {
        this.#created--;
        throw e;
      }
    }
    return new Promise((resolve, reject) => {
      const w = (ctx: Nlc.LlamaContext) => {
        signal.removeEventListener('abort', onAbort);
        resolve(ctx);
      };
      const onAbort = () => {
        this.#waiters.splice(this.#waiters.indexOf(w), 1);
        reject(new ModelRequestError(499, 'aborted while waiting for a context'));
      };
      signal.addEventListener('abort', onAbort, { once: true });
      this.#waiters.push(w);
    });
  }

  async release(ctx: Nlc.LlamaContext): Promise<void> {
    try {
      // A fresh start for the next request: nothing of this one is reused.
      await sequenceOf(ctx).clearHistory();
    } catch {
      this.#created--;
      this.all.splice(this.all.indexOf(ctx), 1);
      void ctx.dispose();
      return;
    }
    const w = this.#waiters.shift();
    if (w) w(ctx);
    else this.#free.push(ctx);
  }
}

const sequences = new WeakMap<Nlc.LlamaContext, Nlc.LlamaContextSequence>();

function sequenceOf(ctx: Nlc.LlamaContext): Nlc.LlamaContextSequence {
  let s = sequences.get(ctx);
  if (!s) {
    s = ctx.getSequence();
    sequences.set(ctx, s);
  }
  return s;
}

/**
 * A GGUF model through node-llama-cpp behind the ServingModel boundary
 * (docs/models.md): greedy answers equal node-llama-cpp's alone.
 */
export class LlamaModel implements ServingModel {
  readonly id: string;
  readonly geometry: KvGeometry;
  readonly compatibilityHash: string;
  /** sha256 of the GGUF (sampled) and the node-llama-cpp / llama.cpp build. */
  readonly fingerprint: Buffer;
  readonly contextSize: number;
  readonly threads: number;
  readonly #nlc: typeof Nlc;
  readonly #model: Nlc.LlamaModel;
  readonly #pool: ContextPool;
  readonly #o: LlamaModelOptions;
  readonly #tmp: string;
  readonly #vocabularySize: number;

  private constructor(
    nlc: typeof Nlc,
    model: Nlc.LlamaModel,
    fingerprint: Buffer,
    o: LlamaModelOptions,
    stateDir: string,
  ) {
    this.#nlc = nlc;
    this.#model = model;
    this.#o = o;
    this.fingerprint = fingerprint;
    this.id = path.basename(o.modelPath).replace(/\.gguf$/i, '');
    this.geometry = { layers: 1, blockBytes: o.blockBytes, tokensPerBlock: 16 };
    this.compatibilityHash = `llama:${fingerprint.toString('hex')}`;
    const trained = model.trainContextSize;
    this.contextSize = Math.min(o.contextSize ?? 4096, trained > 0 ? trained : Number.POSITIVE_INFINITY);
    const parallel = o.parallel ?? 2;
    this.threads = o.threads ?? Math.max(1, Math.floor(os.availableParallelism() / parallel));
    this.#pool = new ContextPool(parallel, () =>
      model.createContext({ contextSize: this.contextSize, threads: this.threads, sequences: 1 }),
    );
    const vocab = model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length;
    this.#vocabularySize = typeof vocab === 'number' ? vocab : Number.MAX_SAFE_INTEGER;
    this.#tmp = stateDir;
  }

  /** Loads node-llama-cpp and the model; NIXL_ERR_NOT_SUPPORTED without node-llama-cpp, NIXL_ERR_INVALID_PARAM for a bad file. */
  static async load(o: LlamaModelOptions): Promise<LlamaModel> {
    for (const k of ['threads', 'contextSize', 'parallel'] as const) {
      const v = o[k];
      if (v !== undefined && (!Number.isInteger(v) || v < 1 || v > 1 << 20))
        throw new NixlError(`${k} must be a positive integer, got ${v}`, 'NIXL_ERR_INVALID_PARAM');
    }
    let st: fs.Stats;
    try {
      st = fs.statSync(o.modelPath);
    } catch {
      throw new NixlError(`no model file ${o.modelPath}`, 'NIXL_ERR_INVALID_PARAM');
    }
    if (!st.isFile()) throw new NixlError(`${o.modelPath} is not a file`, 'NIXL_ERR_INVALID_PARAM');
    const stateDir = makeStateDir(o.stateDir);
    try {
      const nlc = await loadNodeLlamaCpp();
      const llama = await nlc.getLlama({ gpu: o.gpu ?? false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
      let model: Nlc.LlamaModel;
      try {
        model = await llama.loadModel({ modelPath: o.modelPath });
      } catch (e) {
        throw new NixlError(`cannot load ${o.modelPath}: ${(e as Error).message}`, 'NIXL_ERR_INVALID_PARAM');
      }
      const build = JSON.stringify({ nlc: NODE_LLAMA_CPP, release: llama.llamaCppRelease, gpu: llama.gpu });
      return new LlamaModel(nlc, model, modelFingerprint(o.modelPath, st.size, build), o, stateDir);
    } catch (e) {
      fs.rmSync(stateDir, { recursive: true, force: true });
      throw e;
    }
  }

  blocksFor(): undefined {
    return undefined; // the state's size is known once it is evaluated
  }

  async prefill(req: GenerationRequest, signal: AbortSignal): Promise<PrefilledKv> {
    const ctx = await this.#pool.acquire(signal);
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    // Unseeded sampling: one seed for the whole request, the decode's sampler goes on with it.
    const seed = req.temperature > 0 ? (req.seed ?? randomInt(2 ** 32)) : req.seed;
    let state: Buffer;
    let stateTokens: number;
    let nextToken: number | undefined;
    let saveMs = 0;
    try {
      const seq = sequenceOf(ctx);
      // The prompt evaluated exactly as a generation evaluates it, by the
      // generation's own class, up to its first sampled token.
      try {
        await this.#run(firstTokenOf(seq), req, { ...req, seed }, undefined, signal);
      } catch (e) {
        if (!(e instanceof FirstTokenSampled)) throw e;
        nextToken = e.token;
      }
      stateTokens = seq.contextTokens.length;
      const t0 = performance.now();
      await seq.saveStateToFile(file);
      state = await fs.promises.readFile(file);
      saveMs = performance.now() - t0;
    } finally {
      await this.#pool.release(ctx);
      fs.rm(file, { force: true }, () => {});
    }
    const header = stateHeader(state, {
      stateTokens,
      nextToken,
      seed: seed ?? 0,
      samplingKey: samplingKey(req),
      fingerprint: this.fingerprint,
    });
    const { blockBytes } = this.#o;
    return {
      blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
      promptTokens: stateTokens,
      saveMs,
      writeTo: (view) => writeEnvelope(header, state, blockBytes, (i) => view(i, 0)),
    };
  }

  async decode(
    req: GenerationRequest,
    view: BlockView,
    blocks: number,
    out: TextSink,
    signal: AbortSignal,
    blocksRead?: () => void,
  ): Promise<Generated> {
    const t0 = performance.now();
    const env = openEnvelope((i) => view(i, 0), {
      blocks,
      blockBytes: this.#o.blockBytes,
      fingerprint: this.fingerprint,
      maxTokens: this.contextSize,
      maxStateBytes: this.#o.poolBytes - HEADER_BYTES,
      vocabularySize: this.#vocabularySize,
    });
    blocksRead?.(); // the state is a copy now
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    await fs.promises.writeFile(file, env.state);
    const ctx = await this.#pool.acquire(signal);
    try {
      const seq = sequenceOf(ctx);
      await seq.loadStateFromFile(file, { acceptRisk: true });
      const loadMs = performance.now() - t0;
      const loaded = seq.contextTokens.length;
      const before = evaluated(seq);
      // The prefill's next token, where this request samples as the prefill's did.
      const go =
        env.nextToken !== undefined && env.samplingKey === samplingKey(req)
          ? continueFrom(seq, { next: env.nextToken as Nlc.Token, sampled: req.temperature > 0 })
          : undefined;
      const seed = req.temperature > 0 ? (req.seed ?? env.seed) : req.seed;
      const r = await this.#run(go?.sequence ?? seq, req, { ...req, seed }, out, signal);
      return {
        completionTokens: r.completionTokens,
        finishReason: r.finishReason,
        promptTokens: env.stateTokens,
        info: {
          kv_state_bytes: env.state.length,
          kv_tokens_loaded: loaded,
          kv_continued: go?.used() ?? false,
          tokens_evaluated: evaluated(seq) - before,
          kv_load_ms: round(loadMs),
        },
      };
    } finally {
      await this.#pool.release(ctx);
      fs.rm(file, { force: true }, () => {});
    }
  }

  async generate(req: GenerationRequest, out: TextSink, signal: AbortSignal): Promise<Generated> {
    const ctx = await this.#pool.acquire(signal);
    try {
      const r = await this.#run(sequenceOf(ctx), req, req, out, signal);
      return {
        completionTokens: r.completionTokens,
        finishReason: r.finishReason,
        promptTokens: r.promptTokens,
        info: {},
      };
    } finally {
      await this.#pool.release(ctx);
    }
  }

  /** Generates with node-llama-cpp's own classes, as a one-process user would. */
  async #run(
    seq: Nlc.LlamaContextSequence,
    req: GenerationRequest,
    s: Pick<GenerationRequest, 'maxTokens' | 'temperature' | 'topP' | 'seed' | 'stop'>,
    out: TextSink | undefined,
    signal: AbortSignal,
  ): Promise<Omit<Generated, 'info'>> {
    const tokens: Nlc.Token[] = [];
    const text = new WholeText(this.#model, out);
    let promptTokens: number;
    const options = {
      maxTokens: s.maxTokens,
      temperature: s.temperature,
      ...(s.topP !== undefined ? { topP: s.topP } : {}),
      ...(s.seed !== undefined ? { seed: s.seed } : {}),
      ...(s.stop.length ? { customStopTriggers: s.stop } : {}),
      signal,
      onToken: (t: Nlc.Token[]) => {
        tokens.push(...t);
        text.add(t);
      },
    };
    let stopReason: string;
    let final: string;
    if (req.chat) {
      const { history, last } = chatHistory(req.messages, this.id);
      const session = new this.#nlc.LlamaChatSession({ contextSequence: seq, autoDisposeSequence: false });
      try {
        const context = session.chatWrapper.generateContextState({
          chatHistory: [...history, { type: 'user', text: last }, { type: 'model', response: [] }],
        }).contextText;
        promptTokens = context.tokenize(this.#model.tokenizer).length;
        this.#fits(promptTokens, s.maxTokens);
        session.setChatHistory(history);
        ({ stopReason, responseText: final } = await session.promptWithMeta(last, options));
      } finally {
        session.dispose({ disposeSequence: false });
      }
    } else {
      // The prompt and BOS.
      promptTokens = this.#model.tokenize(req.prompt).length + 1;
      this.#fits(promptTokens, s.maxTokens);
      const completion = new this.#nlc.LlamaCompletion({ contextSequence: seq });
      try {
        ({
          response: final,
          metadata: { stopReason },
        } = await completion.generateCompletionWithMeta(req.prompt, options));
      } finally {
        completion.dispose({ disposeSequence: false });
      }
    }
    text.end(final);
    return {
      promptTokens,
      completionTokens: tokens.length,
      finishReason: stopReason === 'maxTokens' ? 'length' : 'stop',
    };
  }

  /**
   * A 400 when the prompt and max_tokens do not fit the context, as vLLM
   * answers: node-llama-cpp would otherwise cut the prompt and answer
   * something else.
   */
  #fits(promptTokens: number, maxTokens: number): void {
    if (promptTokens + maxTokens > this.contextSize)
      throw new ModelRequestError(
        400,
        `this model's context holds ${this.contextSize} tokens; the request needs ${promptTokens + maxTokens} ` +
          `(${promptTokens} in the prompt, ${maxTokens} to generate)`,
      );
  }

  /** Frees the contexts and the model. */
  async close(): Promise<void> {
    for (const c of this.#pool.all) await c.dispose();
    await this.#model.dispose();
    fs.rmSync(this.#tmp, { recursive: true, force: true });
  }
}

function round(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}

function evaluated(seq: Nlc.LlamaContextSequence): number {
  return seq.tokenMeter.usedInputTokens + seq.tokenMeter.usedOutputTokens;
}

/**
 * What chooses a first token: a decode asked to sample otherwise than its
 * prefill (another temperature, top_p or seed) does not take the prefill's
 * next token. 32 bits of a sha256: a check between honest peers.
 */
export function samplingKey(req: Pick<GenerationRequest, 'temperature' | 'topP' | 'seed'>): number {
  const settings = JSON.stringify([req.temperature, req.topP ?? null, req.seed ?? null]);
  return createHash('sha256').update(settings).digest().readUInt32LE(0);
}

/** OpenAI messages as node-llama-cpp's chat history, and the last user message (what is prompted). */
function chatHistory(messages: ChatMessage[], model: string): { history: Nlc.ChatHistoryItem[]; last: string } {
  const text = (m: ChatMessage, i: number): string => {
    if (typeof m.content === 'string') return m.content;
    return m.content
      .map((p, j) => {
        if (p.type !== 'text')
          throw new ModelRequestError(400, `messages[${i}].content[${j}]: ${model} takes text only`);
        return p.text ?? '';
      })
      .join('\n');
  };
  const history: Nlc.ChatHistoryItem[] = messages.map((m, i) => {
    const t = text(m, i);
    switch (m.role) {
      case 'system':
      case 'developer':
        return { type: 'system', text: t };
      case 'user':
        return { type: 'user', text: t };
      case 'assistant':
        return { type: 'model', response: [t] };
      default:
        throw new ModelRequestError(400, `messages[${i}].role '${m.role}': use system, user or assistant`);
    }
  });
  const last = history.pop();
  if (last?.type !== 'user') throw new ModelRequestError(400, 'the last message must be the user’s');
  return { history, last: last.text };
}

/**
 * What a state must come from: the GGUF (its size, its first 16 MiB, its last
 * MiB and 32 slices between: the header, the metadata and weights from end to
 * end, without reading gigabytes) and the node-llama-cpp / llama.cpp build.
 */
export function modelFingerprint(file: string, size: number, build: string): Buffer {
  const h = createHash('sha256').update(`${size}\n${build}\n`);
  const fd = fs.openSync(file, 'r');
  try {
    const read = (at: number, len: number) => {
      const b = Buffer.alloc(Math.max(0, Math.min(len, size - at)));
      fs.readSync(fd, b, 0, b.length, at);
      h.update(b);
    };
    read(0, 16 << 20);
    for (let i = 1; i <= 32; i++) read(Math.floor((size * i) / 33), 64 << 10);
    read(Math.max(0, size - (1 << 20)), 1 << 20);
  } finally {
    fs.closeSync(fd);
  }
  return h.digest();
}
