// A GGUF model through node-llama-cpp (llama.cpp), behind the ServingModel
// boundary. node-llama-cpp is an optional peer dependency, imported only
// here, when a worker is given a GGUF.
//
// prefill  evaluates the prompt the way node-llama-cpp's own LlamaCompletion
//          (or LlamaChatSession, through the model's chat wrapper) would, with
//          one greedy token, then saves the sequence state and wraps it
//          (kv-state.ts) into the request's blocks;
// decode   checks the envelope (model, build, size, checksum or HMAC, the
//          request it was made for) and parses the state for this model and
//          context (llama-state.ts) before llama.cpp sees a byte, loads it
//          into a fresh sequence (a context a failed load touched is thrown
//          away, never reused) and generates with the same
//          class: node-llama-cpp reuses every loaded token that matches the
//          prompt, so only the last prompt token is evaluated again.
// Each request has a context of its own (a pool of `parallel` contexts, one
// sequence each, cleared between requests), so that nothing another request
// evaluates changes this one's numbers.
import { createHash, randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
// Types only (erased): the declarations this file emits name none of them, so
// an application without node-llama-cpp still type-checks against the package.
import type * as Nlc from 'node-llama-cpp';
import { NixlError } from '../../errors';
import { loadNodeLlamaCpp } from './node-llama-cpp';
import { NODE_LLAMA_CPP } from './types';
import { HEADER_BYTES, envelopeBytes, openEnvelope, stateHeader, writeEnvelope } from './kv-state';
import { ContextPool, sequenceOf } from './llama-contexts';
import { type LlamaStateLayout, kvGeometry, learnLayout, parseSeqState } from './llama-state';
import {
  type BlockView,
  type KvBinding,
  KvRejected,
  type ChatMessage,
  type ModelTokenizer,
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
  /** The deployment's KV secret: states are sealed and checked with an HMAC keyed by it (else a checksum). */
  kvSecret?: string;
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
  /** What states of this model look like, or why they cannot be checked (then a decode refuses them all). */
  #layout: LlamaStateLayout | string = 'not probed yet';
  #tokenizer?: ModelTokenizer;

  /** The GGUF's vocabulary (generate endpoint: token ids in and out). */
  get tokenizer(): ModelTokenizer | undefined {
    if (this.#tokenizer) return this.#tokenizer;
    const m = this.#model;
    const vocabSize = (m.fileInfo.metadata as { tokenizer?: { ggml?: { tokens?: readonly unknown[] } } })?.tokenizer
      ?.ggml?.tokens?.length;
    if (!vocabSize) return undefined;
    const bos = m.tokens.shouldPrependBosToken ? m.tokens.bos : null;
    this.#tokenizer = {
      vocabSize,
      ...(bos !== null ? { bos } : {}),
      contextTokens: this.contextSize,
      encode: (text) => m.tokenize(text, false, 'trimLeadingSpace') as number[],
      decode: (ids) => m.detokenize((ids[0] === bos ? ids.slice(1) : ids) as Nlc.Token[], false),
    };
    return this.#tokenizer;
  }

  private constructor(nlc: typeof Nlc, model: Nlc.LlamaModel, fingerprint: Buffer, o: LlamaModelOptions) {
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
    this.#tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-kv-'));
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
    const nlc = await loadNodeLlamaCpp();
    const llama = await nlc.getLlama({ gpu: o.gpu ?? false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    let model: Nlc.LlamaModel;
    try {
      model = await llama.loadModel({ modelPath: o.modelPath });
    } catch (e) {
      throw new NixlError(`cannot load ${o.modelPath}: ${(e as Error).message}`, 'NIXL_ERR_INVALID_PARAM');
    }
    const build = JSON.stringify({ nlc: NODE_LLAMA_CPP, release: llama.llamaCppRelease, gpu: llama.gpu });
    const m = new LlamaModel(nlc, model, modelFingerprint(o.modelPath, st.size, build), o);
    await m.#probeLayout();
    return m;
  }

  /**
   * Learns what this model's states look like: its metadata (layers, K / V
   * widths, vocabulary) and a state its own llama.cpp saves (cache types, V
   * transposition) must agree, or no state can be checked and none is loaded.
   */
  async #probeLayout(): Promise<void> {
    const geometry = kvGeometry(this.#model.fileInfo.metadata);
    const nVocab = (this.#model.fileInfo.metadata as { tokenizer?: { ggml?: { tokens?: readonly unknown[] } } })
      ?.tokenizer?.ggml?.tokens?.length;
    if (!geometry || !nVocab) {
      this.#layout = "the GGUF's metadata does not give its KV geometry and vocabulary";
      return;
    }
    const ctx = await this.#pool.acquire(new AbortController().signal);
    const file = path.join(this.#tmp, 'probe.state');
    try {
      const seq = sequenceOf(ctx);
      await seq.evaluateWithoutGeneratingNewTokens(this.#model.tokenize('probe', false).slice(0, 3));
      await seq.saveStateToFile(file);
      this.#layout = learnLayout(fs.readFileSync(file), geometry, nVocab, ctx.contextSize);
    } catch (e) {
      this.#layout = `its states are not in a layout nixl-node can check (${(e as Error).message})`;
    } finally {
      fs.rmSync(file, { force: true });
      await this.#pool.release(ctx);
    }
  }

  /** What this model's states must look like (a decode parses each against it), or why none can be checked. */
  get stateLayout(): LlamaStateLayout | string {
    return this.#layout;
  }

  /** Why this model cannot serve now (no context can be made), or undefined. */
  unhealthy(): string | undefined {
    return this.#pool.broken;
  }

  /** Contexts thrown away because a request may have left them unusable. */
  get discardedContexts(): number {
    return this.#pool.discarded;
  }

  blocksFor(): undefined {
    return undefined; // the state's size is known once it is evaluated
  }

  async prefill(req: GenerationRequest, signal: AbortSignal): Promise<PrefilledKv> {
    const ctx = await this.#pool.acquire(signal);
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    let state: Buffer;
    let promptTokens: number;
    let firstToken: number | 'end' | undefined;
    let saveMs = 0;
    try {
      const seq = sequenceOf(ctx);
      // One greedy token: the prompt evaluated exactly as a generation would;
      // a greedy decode starts from that token (see #continue).
      const r = await this.#run(
        seq,
        req,
        { ...req, maxTokens: 1, temperature: 0, seed: undefined, stop: [] },
        undefined,
        signal,
      );
      firstToken = r.tokens.length > 0 ? r.tokens[0] : r.finishReason === 'stop' ? 'end' : undefined;
      promptTokens = seq.contextTokens.length;
      const t0 = performance.now();
      await seq.saveStateToFile(file);
      state = await fs.promises.readFile(file);
      saveMs = performance.now() - t0;
    } finally {
      await this.#pool.release(ctx);
      fs.rm(file, { force: true }, () => {});
    }
    const { blockBytes, kvSecret } = this.#o;
    const info = { promptTokens, firstToken, fingerprint: this.fingerprint };
    return {
      blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
      promptTokens,
      saveMs,
      writeTo: (view, binding) =>
        writeEnvelope(stateHeader(state, { ...info, binding }, kvSecret), state, blockBytes, (i) => view(i, 0)),
    };
  }

  async decode(
    req: GenerationRequest,
    view: BlockView,
    blocks: number,
    out: TextSink,
    signal: AbortSignal,
    blocksRead?: () => void,
    binding?: KvBinding,
  ): Promise<Generated> {
    const t0 = performance.now();
    const { state, promptTokens, firstToken } = this.#open(view, blocks, binding);
    blocksRead?.(); // the state is a copy now
    // Every path below (the greedy ones too) fits the context, or nothing is loaded.
    this.#fits(promptTokens, req.maxTokens);
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    await fs.promises.writeFile(file, state);
    const ctx = await this.#pool.acquire(signal);
    // Whatever goes wrong once llama.cpp has the state, this context is not reused.
    let clean = false;
    try {
      const seq = sequenceOf(ctx);
      try {
        await seq.loadStateFromFile(file, { acceptRisk: true });
      } catch (e) {
        throw new KvRejected(`llama.cpp refused the KV state: ${(e as Error).message}`, 'refused');
      }
      const loadMs = performance.now() - t0;
      const loaded = seq.contextTokens.length;
      const before = evaluated(seq);
      const r =
        req.temperature !== 0 || firstToken === undefined
          ? await this.#run(seq, req, req, out, signal)
          : req.chat
            ? await this.#continueChat(seq, req, firstToken, out, signal)
            : await this.#continue(seq, req, firstToken, out, signal);
      clean = true;
      return {
        completionTokens: r.completionTokens,
        finishReason: r.finishReason,
        promptTokens,
        info: {
          kv_state_bytes: state.length,
          kv_tokens_loaded: loaded,
          tokens_evaluated: evaluated(seq) - before,
          kv_load_ms: round(loadMs),
        },
      };
    } catch (e) {
      // A request's own 4xx (or its client gone) leaves a state llama.cpp made: clearing it is enough.
      if (e instanceof ModelRequestError || signal.aborted) clean = true;
      throw e;
    } finally {
      await (clean ? this.#pool.release(ctx) : this.#pool.discard(ctx));
      fs.rm(file, { force: true }, () => {});
    }
  }

  /**
   * The state in the blocks, checked: the envelope (model, size, MAC, the
   * request it is for), then every byte of the state for this model and
   * context. Throws KvRejected; llama.cpp has seen nothing.
   */
  #open(view: BlockView, blocks: number, binding: KvBinding | undefined) {
    if (!binding) throw new KvRejected('no request to check the KV state against', 'wrong-request');
    if (typeof this.#layout === 'string')
      throw new KvRejected(`this decode cannot check KV states of ${this.id}: ${this.#layout}`, 'unsupported');
    const layout = this.#layout;
    const opened = openEnvelope((i) => view(i, 0), {
      blocks,
      blockBytes: this.#o.blockBytes,
      fingerprint: this.fingerprint,
      binding,
      secret: this.#o.kvSecret,
      maxTokens: this.contextSize,
      maxStateBytes: this.#o.poolBytes - HEADER_BYTES,
    });
    const parsed = parseSeqState(opened.state, layout);
    if (parsed.tokens.length !== opened.promptTokens)
      throw new KvRejected(
        `the KV state holds ${parsed.tokens.length} tokens, its envelope says ${opened.promptTokens}`,
        'malformed',
      );
    const f = opened.firstToken;
    if (typeof f === 'number' && f >= layout.nVocab)
      throw new KvRejected(`the first token ${f} is outside the vocabulary of ${layout.nVocab}`, 'malformed');
    return opened;
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
    /** Chat: the answer starts with this text (the prefill's first token). */
    responsePrefix?: string,
  ): Promise<Omit<Generated, 'info'> & { tokens: Nlc.Token[] }> {
    const tokens: Nlc.Token[] = [];
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
      },
      ...(out ? { onTextChunk: out } : {}),
    };
    let stopReason: string;
    if (req.chat) {
      const { history, last } = chatHistory(req.messages, this.id);
      const session = new this.#nlc.LlamaChatSession({ contextSequence: seq, autoDisposeSequence: false });
      try {
        const context = session.chatWrapper.generateContextState({
          chatHistory: [...history, { type: 'user', text: last }, { type: 'model', response: [] }],
        }).contextText;
        promptTokens = context.tokenize(this.#model.tokenizer).length;
        this.#fits(promptTokens, Math.max(s.maxTokens, req.decodeMaxTokens ?? 0));
        session.setChatHistory(history);
        ({ stopReason } = await session.promptWithMeta(last, {
          ...options,
          ...(responsePrefix !== undefined ? { responsePrefix } : {}),
        }));
      } finally {
        session.dispose({ disposeSequence: false });
      }
    } else {
      // What LlamaCompletion evaluates: BOS when the vocabulary prepends one,
      // then the prompt without the tokenizer's leading space (or the ids as given).
      const bos = this.#model.tokens.shouldPrependBosToken && this.#model.tokens.bos !== null;
      const input = req.promptTokens ? (req.promptTokens as Nlc.Token[]) : req.prompt;
      promptTokens =
        (req.promptTokens ?? this.#model.tokenize(req.prompt, false, bos ? 'trimLeadingSpace' : undefined)).length +
        (bos ? 1 : 0);
      this.#fits(promptTokens, Math.max(s.maxTokens, req.decodeMaxTokens ?? 0));
      const completion = new this.#nlc.LlamaCompletion({ contextSequence: seq });
      try {
        ({
          metadata: { stopReason },
        } = await completion.generateCompletionWithMeta(input, options));
      } finally {
        completion.dispose({ disposeSequence: false });
      }
    }
    return {
      tokens,
      promptTokens,
      completionTokens: tokens.length,
      finishReason: stopReason === 'maxTokens' ? 'length' : 'stop',
    };
  }

  /**
   * A greedy chat answer from a loaded state: LlamaChatSession, told that the
   * answer starts with the prefill's first token, evaluates that token alone
   * (as a single generation does) and goes on, instead of evaluating the
   * prompt's last token again (see #continue). A first token whose text
   * would not tokenize back to itself in context (whitespace, with
   * SentencePiece vocabularies) takes the plain path.
   */
  async #continueChat(
    seq: Nlc.LlamaContextSequence,
    req: GenerationRequest,
    first: number | 'end',
    out: TextSink | undefined,
    signal: AbortSignal,
  ): Promise<{ completionTokens: number; finishReason: 'stop' | 'length' }> {
    if (first === 'end') return { completionTokens: 0, finishReason: 'stop' };
    const prefix = this.#model.detokenize([first as Nlc.Token], false, seq.contextTokens);
    if (prefix.length === 0 || prefix.trim() !== prefix || req.stop.some((x) => prefix.includes(x)))
      return this.#run(seq, req, req, out, signal);
    if (req.maxTokens === 1) {
      out?.(prefix);
      return { completionTokens: 1, finishReason: 'length' };
    }
    const before = evaluated(seq);
    const r = await this.#run(seq, req, { ...req, maxTokens: req.maxTokens - 1 }, out, signal, prefix);
    // onToken also counts the prefix as the chat wrapper tokenized it: count
    // what was evaluated instead (the first token, then every generated one
    // but the last, which nothing evaluates when max_tokens ends the answer).
    const n = evaluated(seq) - before + (r.finishReason === 'length' ? 1 : 0);
    return { completionTokens: Math.min(req.maxTokens, n), finishReason: r.finishReason };
  }

  /**
   * A greedy completion from a loaded state, starting from the first token
   * the prefill took: the prompt's last token is not evaluated again, so
   * every number is the one a single process computes (llama.cpp evaluates
   * a token alone and inside a batch with results that differ in the last
   * bits, enough to change a greedy token now and then).
   */
  async #continue(
    seq: Nlc.LlamaContextSequence,
    req: GenerationRequest,
    first: number | 'end',
    out: TextSink | undefined,
    signal: AbortSignal,
  ): Promise<{ completionTokens: number; finishReason: 'stop' | 'length' }> {
    const text = new StopText(this.#model, req.stop, out);
    if (first === 'end') return { completionTokens: 0, finishReason: 'stop' };
    const t1 = first as Nlc.Token;
    if (text.push([t1])) return { completionTokens: 1, finishReason: 'stop' };
    // LlamaCompletion would evaluate the whole prompt again with the first
    // token in the batch (other numbers): the sequence's own generator
    // evaluates only that token, as a single generation does next.
    const generated: Nlc.Token[] = [t1];
    const nl = this.#model.tokens.nl;
    let finishReason: 'stop' | 'length' = 'length';
    if (req.maxTokens > 1) {
      const it = seq.evaluate([t1], {
        temperature: 0,
        // As LlamaCompletion punishes repeats: the last 64 generated tokens, new lines aside.
        repeatPenalty: {
          punishTokens: () => generated.slice(-64).filter((t) => t !== nl),
          maxPunishTokens: 64,
        },
        yieldEogToken: true,
      });
      for await (const t of it) {
        if (signal.aborted) throw signal.reason;
        if (this.#model.isEogToken(t)) {
          finishReason = 'stop';
          break;
        }
        generated.push(t);
        if (text.push([t])) {
          finishReason = 'stop';
          break;
        }
        if (generated.length >= req.maxTokens) break;
      }
    }
    const n = generated.length;
    text.end();
    return { completionTokens: n, finishReason };
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

/**
 * The text of generated tokens as it grows: cut at the first stop string,
 * streamed without a partial character or the start of a stop string.
 */
class StopText {
  readonly #tokens: Nlc.Token[] = [];
  #sent = 0;
  #done = false;
  readonly #hold: number;

  constructor(
    readonly model: Nlc.LlamaModel,
    readonly stop: string[],
    readonly out: TextSink | undefined,
  ) {
    this.#hold = Math.max(0, ...stop.map((x) => x.length - 1));
  }

  /** Adds tokens; true when a stop string ended the text. */
  push(ts: Nlc.Token[]): boolean {
    if (this.#done) return true;
    this.#tokens.push(...ts);
    const full = this.model.detokenize(this.#tokens);
    const at = Math.min(...this.stop.map((x) => full.indexOf(x)).filter((i) => i >= 0));
    if (Number.isFinite(at)) {
      this.#emit(full.slice(0, at));
      this.#done = true;
      return true;
    }
    let safe = full.length - this.#hold;
    while (safe > 0 && full[safe - 1] === '\uFFFD') safe--;
    this.#emit(full.slice(0, Math.max(safe, this.#sent)));
    return false;
  }

  end(): void {
    if (!this.#done) this.#emit(this.model.detokenize(this.#tokens));
    this.#done = true;
  }

  #emit(upTo: string): void {
    if (upTo.length > this.#sent) this.out?.(upTo.slice(this.#sent));
    this.#sent = Math.max(this.#sent, upTo.length);
  }
}

function round(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}

function evaluated(seq: Nlc.LlamaContextSequence): number {
  return seq.tokenMeter.usedInputTokens + seq.tokenMeter.usedOutputTokens;
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
