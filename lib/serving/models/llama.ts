// A GGUF model through node-llama-cpp (llama.cpp), behind the ServingModel
// boundary. node-llama-cpp is an optional peer dependency, imported only
// here, when a worker is given a GGUF.
//
// prefill  runs node-llama-cpp's own LlamaCompletion (or LlamaChatSession,
//          through the model's chat template) until the sequence has sampled
//          its first token, saves the sequence state (exactly the prompt)
//          and wraps it with that token (kv-state.ts) into the request's
//          blocks;
// decode   checks the envelope (model, build, size, checksum or HMAC, the
//          request it was made for) and parses the state for this model and
//          context (llama-state.ts) before llama.cpp sees a byte, loads it
//          into a fresh sequence (a context a failed load touched is thrown
//          away, never reused) and runs the same class again on a view that
//          continues from the first token (llama-continue.ts): every number
//          and every rule is the class's.
// Each request has a context of its own (a pool of `parallel` contexts, one
// sequence each), so that nothing another request evaluates changes this
// one's numbers. A prefill or generation reuses the prompt an earlier request
// left in its context as far as that changes no number: whole batches of the
// common prefix (llama-prefix.ts).
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
import { type Continuation, HEADER_BYTES, envelopeBytes, openEnvelope, stateHeader, writeEnvelope } from './kv-state';
import { ContextPool, exactOf, sequenceOf } from './llama-contexts';
import { reusableTokens, reusing } from './llama-prefix';
import { type LlamaStateLayout, kvGeometry, learnLayout, parseSeqState, truncateSeqState } from './llama-state';
import { checkOwnPrompt, evaluatedPrompt, pushSize, unpushable } from './llama-push';
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
  type PrefixCacheListener,
  type PreviousTurn,
  type ServingModel,
  type TextSink,
  type TurnKvState,
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
  /** Tokens llama.cpp evaluates in one batch (default node-llama-cpp's: the context size, at most 512). */
  batchSize?: number;
  /**
   * Reuse the prompt an earlier request left in a context, in whole batches
   * (default true): the numbers are a fresh evaluation's.
   */
  prefixCache?: boolean;
  /** Bytes of one KV block of the worker's pool. */
  blockBytes: number;
  /** Bytes of the whole pool: the largest state a decode takes. */
  poolBytes: number;
  /** node-llama-cpp's GPU backend (default false: CPU). */
  gpu?: false | 'auto';
  /** The deployment's KV secret: states are sealed and checked with an HMAC keyed by it (else a checksum). */
  kvSecret?: string;
  /**
   * Where states go through files on their way in and out of llama.cpp
   * (default: NIXL_NODE_STATE_DIR, else /dev/shm where it is a writable
   * memory file system, else the OS temp dir).
   */
  stateDir?: string;
}

/**
 * A GGUF model through node-llama-cpp behind the ServingModel boundary
 * (docs/models.md): greedy answers equal node-llama-cpp's alone.
 */
// One llama.cpp binding per process and GPU setting, shared by every model it
// loads: each getLlama() makes another, which holds its backend and a
// process 'beforeExit' listener until disposed, so workers started and closed
// in one process (tests, the bench) would pile them up.
const llamas = new Map<string, Promise<Nlc.Llama>>();
function sharedLlama(nlc: typeof Nlc, gpu: NonNullable<LlamaModelOptions['gpu']>): Promise<Nlc.Llama> {
  const key = JSON.stringify(gpu);
  let p = llamas.get(key);
  if (!p) {
    p = nlc.getLlama({ gpu, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    llamas.set(key, p);
    p.catch(() => llamas.delete(key));
  }
  return p;
}

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
  /** The contexts' batch size (learned from the probe's context). */
  #batch = 0;
  #tokenizer?: ModelTokenizer;
  #chatWrapper?: Nlc.ChatWrapper;

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
      model.createContext({
        contextSize: this.contextSize,
        threads: this.threads,
        sequences: 1,
        ...(o.batchSize !== undefined ? { batchSize: o.batchSize } : {}),
      }),
    );
    this.#tmp = stateDir;
  }

  /** Loads node-llama-cpp and the model; NIXL_ERR_NOT_SUPPORTED without node-llama-cpp, NIXL_ERR_INVALID_PARAM for a bad file. */
  static async load(o: LlamaModelOptions): Promise<LlamaModel> {
    for (const k of ['threads', 'contextSize', 'parallel', 'batchSize'] as const) {
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
      const llama = await sharedLlama(nlc, o.gpu ?? false);
      let model: Nlc.LlamaModel;
      try {
        model = await llama.loadModel({ modelPath: o.modelPath });
      } catch (e) {
        throw new NixlError(`cannot load ${o.modelPath}: ${(e as Error).message}`, 'NIXL_ERR_INVALID_PARAM');
      }
      const build = JSON.stringify({ nlc: NODE_LLAMA_CPP, release: llama.llamaCppRelease, gpu: llama.gpu });
      const m = new LlamaModel(nlc, model, modelFingerprint(o.modelPath, st.size, build), o, stateDir);
      await m.#probeLayout();
      return m;
    } catch (e) {
      fs.rmSync(stateDir, { recursive: true, force: true });
      throw e;
    }
  }

  /** KV events: the whole batches its contexts keep (none without the prefix cache: nothing is reused then). */
  watchPrefixCache(l: (blockSize: number) => PrefixCacheListener): void {
    if (this.#o.prefixCache !== false) this.#pool.listener = l(this.#batch || (this.#o.batchSize ?? 512));
  }

  resetPrefixCache(): void {
    this.#pool.forgetPrefixes();
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
    this.#batch = ctx.batchSize;
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

  /**
   * A held turn is one sequence state, read whole: its first whole batches
   * that a prompt starts with are loaded, and the rest evaluated from a batch
   * boundary, which changes no number (llama-prefix.ts).
   */
  get wholeTurnReuse(): { granularity: number } {
    return { granularity: this.#batch };
  }

  /** Why this model cannot serve now (no context can be made), or undefined. */
  unhealthy(): string | undefined {
    return this.#pool.broken;
  }

  /** Contexts thrown away because a request may have left them unusable. */
  get discardedContexts(): number {
    return this.#pool.discarded;
  }

  /** The tokens the prompt evaluates as (a prefill proves a previous turn's KV is of its first ones); none for a bad chat. */
  promptTokenIds(req: GenerationRequest): readonly number[] {
    return this.#promptOf(req) ?? [];
  }

  blocksFor(): undefined {
    return undefined; // the state's size is known once it is evaluated
  }

  /** Push decode: the blocks of the state a prefill saves for this prompt, computed from its tokens (llama-push.ts). */
  pushBlocksFor(req: GenerationRequest): number {
    if (typeof this.#layout === 'string')
      throw new KvRejected(`this decode cannot check KV states of ${this.id}: ${this.#layout}`, 'unsupported');
    const tokens = this.#promptOf(req);
    if (!tokens) {
      chatHistory(req.messages, this.id); // a chat that is not valid: its 400, as the prefill answers
      throw new ModelRequestError(400, 'the messages give no prompt');
    }
    this.#fits(tokens.length, req.maxTokens);
    const evaluated = this.#pushPromptOf(req)!;
    if (typeof evaluated === 'string') throw new ModelRequestError(400, evaluated);
    return pushSize(this.#layout, evaluated.length, this.#o.blockBytes).blocks;
  }

  /** Push: the tokens node-llama-cpp evaluates of a request's prompt (llama-push.ts), or why they cannot be known. */
  #pushPromptOf(req: GenerationRequest): readonly number[] | string | undefined {
    if (typeof this.#layout === 'string') return this.#layout;
    const tokens = this.#promptOf(req);
    const bos = !req.chat && this.#model.tokens.shouldPrependBosToken && this.#model.tokens.bos !== null;
    // The context's own size (nCtx: what llama.cpp made of contextSize), as the classes read it.
    return tokens && evaluatedPrompt(tokens, { chat: req.chat, contextSize: this.#layout.nCtx, bos });
  }

  async prefill(req: GenerationRequest, signal: AbortSignal, previous?: PreviousTurn): Promise<PrefilledKv> {
    const prompt = this.#promptOf(req);
    const prior = previous ? this.#previousTurn(previous, prompt) : undefined;
    let ctx = await this.#pool.acquire(signal, prompt);
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    // Unseeded sampling: one seed for the whole request, the decode's sampler goes on with it.
    const seed = req.temperature > 0 ? (req.seed ?? randomInt(2 ** 32)) : req.seed;
    let state: Buffer;
    let promptTokens: number;
    let nextToken: number | undefined;
    let saved: number[] = [];
    let saveMs = 0;
    let exactTokens = 0;
    let keep = 0;
    let exact = this.#o.prefixCache === false ? 0 : exactOf(ctx);
    let turn: PrefilledKv['turn'] = prior?.skipped !== undefined ? { reused: 0, skipped: prior.skipped } : undefined;
    if (prior?.state) {
      const loaded = await this.#loadPrefix(ctx, prior.state, prior.tokens, prompt!, exact, signal);
      ctx = loaded.ctx;
      if (loaded.skipped === undefined) exact = prior.tokens;
      else if (loaded.skipped === 'refused') exact = this.#o.prefixCache === false ? 0 : exactOf(ctx);
      turn = { reused: 0, ...(loaded.skipped !== undefined ? { skipped: loaded.skipped } : {}) };
    }
    const seq = sequenceOf(ctx);
    const r = reusing(seq, exact);
    const before = evaluated(seq);
    try {
      // The prompt evaluated exactly as a generation evaluates it, by the
      // generation's own class, up to its first sampled token.
      try {
        await this.#run(firstTokenOf(r.sequence), req, { ...req, seed }, undefined, signal);
      } catch (e) {
        if (!(e instanceof FirstTokenSampled)) throw e;
        nextToken = e.token;
      }
      promptTokens = seq.contextTokens.length;
      saved = [...seq.contextTokens];
      const t0 = performance.now();
      await seq.saveStateToFile(file);
      state = await fs.promises.readFile(file);
      saveMs = performance.now() - t0;
      exactTokens = r.exactAfter();
      keep = this.#o.prefixCache === false ? 0 : exactTokens;
    } finally {
      await this.#pool.release(ctx, keep);
      fs.rm(file, { force: true }, () => {});
    }
    const { blockBytes, kvSecret } = this.#o;
    const B = ctx.batchSize;
    const info = {
      promptTokens,
      nextToken,
      seed: seed ?? 0,
      samplingKey: samplingKey(req),
      fingerprint: this.fingerprint,
      // Its whole batches are a fresh evaluation's (what a decode may keep of them for a next turn).
      batch: exactTokens === promptTokens - (promptTokens % B) ? B : 0,
    };
    // Tokens taken from the previous turn's state, or else from the context's own cache.
    if (turn && turn.skipped === undefined) turn = { reused: r.reused() };
    return {
      blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
      promptTokens,
      saveMs,
      ...(turn ? { turn } : {}),
      info: {
        prefix_reused_tokens: turn?.skipped === undefined && turn ? 0 : r.reused(),
        tokens_evaluated: evaluated(seq) - before,
      },
      whole: true,
      unpushable: unpushable(this.#layout, this.#pushPromptOf(req), saved, state.length),
      writeTo: (view, binding) =>
        writeEnvelope(stateHeader(state, { ...info, binding }, kvSecret), state, blockBytes, (i) => view(i, 0)),
    };
  }

  /**
   * What a prefill may load of a previous turn's state (read whole into the
   * prefill's blocks): the envelope checked as a decode checks it (bound to
   * the hold the params name), the state parsed, evaluated in batches of this
   * context's size, and its tokens the prompt's first ones; cut to the
   * whole batches the two share, leaving the prompt's last token to compute.
   */
  #previousTurn(
    previous: PreviousTurn,
    prompt: readonly Nlc.Token[] | undefined,
  ): { state?: Buffer; tokens: number; skipped?: string } {
    const none = (skipped: string) => ({ tokens: 0, skipped });
    if (!prompt) return none('mismatch');
    let opened: Continuation & { state: Buffer; tokens: number[] };
    try {
      opened = this.#open(previous.view, previous.blocks, previous.binding);
    } catch (e) {
      if (e instanceof KvRejected) return none(`rejected:${e.reason}`);
      throw e;
    }
    const B = this.#batch;
    if (opened.batch !== B) return none('batch-size');
    const held = opened.tokens;
    let same = 0;
    const limit = Math.min(held.length, prompt.length - 1, previous.tokens);
    while (same < limit && held[same] === prompt[same]) same++;
    const tokens = same - (same % B);
    if (tokens === 0) return none('mismatch');
    return { state: truncateSeqState(opened.state, this.#layout as LlamaStateLayout, tokens), tokens };
  }

  /**
   * Loads `state` (the first `tokens` tokens of a previous turn) into ctx's
   * sequence, unless the context already caches as much of the prompt; a
   * context llama.cpp refused the state in is thrown away for a fresh one.
   */
  async #loadPrefix(
    ctx: Nlc.LlamaContext,
    state: Buffer,
    tokens: number,
    prompt: readonly Nlc.Token[],
    exact: number,
    signal: AbortSignal,
  ): Promise<{ ctx: Nlc.LlamaContext; skipped?: string }> {
    const seq = sequenceOf(ctx);
    if (reusableTokens(seq.contextTokens, exact, prompt, ctx.batchSize) >= tokens) return { ctx, skipped: 'cached' };
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    try {
      await fs.promises.writeFile(file, state);
      if (seq.nextTokenIndex > 0) await seq.clearHistory();
      await seq.loadStateFromFile(file, { acceptRisk: true });
      return { ctx };
    } catch {
      await this.#pool.discard(ctx);
      return { ctx: await this.#pool.acquire(signal, prompt as Nlc.Token[]), skipped: 'refused' };
    } finally {
      fs.rm(file, { force: true }, () => {});
    }
  }

  /**
   * The KV a next turn may read, made on the decode's context after it
   * answered: the tokens the next prompt will start with (the history
   * rendered with this answer, as far as it renders to the tokens the
   * context holds), cut to whole batches, and evaluated again from the last
   * batch boundary that is a fresh evaluation's, in batches from there, so
   * that every number is what a fresh prefill of them computes
   * (test/serving/llama-turn-kv.test.ts). Undefined: nothing to hold.
   */
  async #keepTurn(
    seq: Nlc.LlamaContextSequence,
    req: GenerationRequest,
    text: string,
    exactPrompt: number,
  ): Promise<{ turn?: TurnKvState; exact: number }> {
    const B = seq.context.batchSize;
    const context = [...seq.contextTokens];
    const next = req.promptTokens ? context : this.#nextPromptOf(req, text);
    let same = 0;
    while (next && same < Math.min(context.length, next.length) && context[same] === next[same]) same++;
    const tokens = same - (same % B);
    if (tokens === 0) return { exact: 0 };
    const from = Math.min(exactPrompt - (exactPrompt % B), tokens);
    await seq.eraseContextTokenRanges([{ start: from, end: seq.nextTokenIndex }]);
    if (from < tokens) await seq.evaluateWithoutGeneratingNewTokens(context.slice(from, tokens));
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    let state: Buffer;
    try {
      await seq.saveStateToFile(file);
      state = await fs.promises.readFile(file);
    } finally {
      fs.rm(file, { force: true }, () => {});
    }
    const { blockBytes, kvSecret } = this.#o;
    const info = { promptTokens: tokens, seed: 0, samplingKey: 0, batch: B, fingerprint: this.fingerprint };
    return {
      exact: tokens,
      turn: {
        tokens: context.slice(0, tokens),
        blocks: Math.ceil(envelopeBytes(state.length) / blockBytes),
        writeTo: (view, binding) =>
          writeEnvelope(stateHeader(state, { ...info, binding }, kvSecret), state, blockBytes, (i) => view(i, 0)),
      },
    };
  }

  /** The tokens of the next turn's prompt, as far as they follow from this request and its answer. */
  #nextPromptOf(req: GenerationRequest, text: string): Nlc.Token[] | undefined {
    if (!req.chat) return this.#promptOf({ ...req, prompt: req.prompt + text });
    // A user message after the answer: how the template closes the answer.
    return this.#chatTokens(req, [
      { type: 'model', response: [text] },
      { type: 'user', text: '.' },
      { type: 'model', response: [] },
    ]);
  }

  /** A chat's tokens as its template renders them: the messages, then `after` (undefined: messages not valid). */
  #chatTokens(req: GenerationRequest, after: Nlc.ChatHistoryItem[]): Nlc.Token[] | undefined {
    let h: ReturnType<typeof chatHistory>;
    try {
      h = chatHistory(req.messages, this.id);
    } catch {
      return undefined;
    }
    this.#chatWrapper ??= this.#nlc.resolveChatWrapper(this.#model);
    return this.#chatWrapper
      .generateContextState({ chatHistory: [...h.history, { type: 'user', text: h.last }, ...after] })
      .contextText.tokenize(this.#model.tokenizer);
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
    const env = this.#open(view, blocks, binding, req);
    const { state, promptTokens } = env;
    blocksRead?.(); // the state is a copy now
    // Every path below (the greedy ones too) fits the context, or nothing is loaded.
    this.#fits(promptTokens, req.maxTokens);
    const file = path.join(this.#tmp, `${randomUUID()}.state`);
    await fs.promises.writeFile(file, state);
    const ctx = await this.#pool.acquire(signal);
    // Whatever goes wrong once llama.cpp has the state, this context is not reused.
    let clean = false;
    let keep = 0;
    try {
      const seq = sequenceOf(ctx);
      if (seq.nextTokenIndex > 0) await seq.clearHistory(); // a prompt kept for reuse
      try {
        await seq.loadStateFromFile(file, { acceptRisk: true });
      } catch (e) {
        throw new KvRejected(`llama.cpp refused the KV state: ${(e as Error).message}`, 'refused');
      }
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
      const evaluatedHere = evaluated(seq) - before;
      let turn: TurnKvState | undefined;
      let turnMs: number | undefined;
      clean = true;
      if (req.keepTurn && !signal.aborted) {
        const t1 = performance.now();
        try {
          const kept = await this.#keepTurn(seq, req, r.text, exactPrompt(env, seq, go?.used() ?? false));
          turn = kept.turn;
          keep = kept.exact;
          turnMs = performance.now() - t1;
        } catch {
          // The answer stands; the next turn recomputes, and this context is not reused.
          clean = false;
        }
      }
      return {
        completionTokens: r.completionTokens,
        finishReason: r.finishReason,
        promptTokens,
        ...(turn ? { turn } : {}),
        info: {
          kv_state_bytes: state.length,
          kv_tokens_loaded: loaded,
          kv_continued: go?.used() ?? false,
          tokens_evaluated: evaluatedHere,
          kv_load_ms: round(loadMs),
          // Holding the turn for the next one: evaluating again in whole batches, saving.
          ...(turnMs !== undefined ? { turn_kv_ms: round(turnMs), turn_kv_tokens: turn?.tokens.length ?? 0 } : {}),
        },
      };
    } catch (e) {
      // A request's own 4xx (or its client gone) leaves a state llama.cpp made: clearing it is enough.
      if (e instanceof ModelRequestError || signal.aborted) clean = true;
      throw e;
    } finally {
      await (clean ? this.#pool.release(ctx, this.#o.prefixCache === false ? 0 : keep) : this.#pool.discard(ctx));
      fs.rm(file, { force: true }, () => {});
    }
  }

  /**
   * The state in the blocks, checked: the envelope (model, size, MAC, the
   * request it is for), then every byte of the state for this model and
   * context. Throws KvRejected; llama.cpp has seen nothing.
   */
  #open(view: BlockView, blocks: number, binding: KvBinding | undefined, req?: GenerationRequest) {
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
    if (binding.ownPrompt) {
      const own = req && this.#pushPromptOf(req);
      checkOwnPrompt(parsed.tokens, typeof own === 'string' ? undefined : own);
    }
    const f = opened.nextToken;
    if (f !== undefined && f >= layout.nVocab)
      throw new KvRejected(`the next token ${f} is outside the vocabulary of ${layout.nVocab}`, 'malformed');
    return { ...opened, tokens: parsed.tokens };
  }

  async generate(req: GenerationRequest, out: TextSink, signal: AbortSignal): Promise<Generated> {
    const ctx = await this.#pool.acquire(signal, this.#promptOf(req));
    const seq = sequenceOf(ctx);
    const reuse = reusing(seq, this.#o.prefixCache === false ? 0 : exactOf(ctx));
    const before = evaluated(seq);
    let keep = 0;
    try {
      const r = await this.#run(reuse.sequence, req, req, out, signal);
      keep = this.#o.prefixCache === false ? 0 : reuse.exactAfter();
      return {
        completionTokens: r.completionTokens,
        finishReason: r.finishReason,
        promptTokens: r.promptTokens,
        info: { prefix_reused_tokens: reuse.reused(), tokens_evaluated: evaluated(seq) - before },
      };
    } finally {
      await this.#pool.release(ctx, keep);
    }
  }

  /**
   * The tokens a request's prompt evaluates as, as the class computes them
   * (LlamaCompletion: BOS, then the prompt without the tokenizer's leading
   * space, or the ids as given; LlamaChat: its chat template's context); a
   * chat whose messages are not valid gives none (#run answers the 400).
   */
  #promptOf(req: GenerationRequest): Nlc.Token[] | undefined {
    if (req.chat) return this.#chatTokens(req, [{ type: 'model', response: [] }]);
    const m = this.#model;
    const bos = m.tokens.shouldPrependBosToken ? m.tokens.bos : null;
    const tokens = req.promptTokens
      ? (req.promptTokens as Nlc.Token[])
      : m.tokenize(req.prompt, false, bos !== null ? 'trimLeadingSpace' : undefined);
    return bos !== null ? [bos, ...tokens] : tokens;
  }

  /** Generates with node-llama-cpp's own classes, as a one-process user would. */
  async #run(
    seq: Nlc.LlamaContextSequence,
    req: GenerationRequest,
    s: Pick<GenerationRequest, 'maxTokens' | 'temperature' | 'topP' | 'seed' | 'stop'>,
    out: TextSink | undefined,
    signal: AbortSignal,
  ): Promise<Omit<Generated, 'info'> & { text: string }> {
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
        this.#fits(promptTokens, Math.max(s.maxTokens, req.decodeMaxTokens ?? 0));
        session.setChatHistory(history);
        ({ stopReason, responseText: final } = await session.promptWithMeta(last, options));
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
          response: final,
          metadata: { stopReason },
        } = await completion.generateCompletionWithMeta(input, options));
      } finally {
        completion.dispose({ disposeSequence: false });
      }
    }
    text.end(final);
    return {
      text: final,
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

/**
 * Leading tokens of a decode's sequence that still hold its prefill's
 * numbers, evaluated in whole batches from 0 (a held turn evaluates again
 * only what follows their last whole batch): none when the prefill evaluated
 * in batches of another size; without the continuation the class evaluated
 * the prompt's last token again; and the prompt must be what was loaded.
 */
function exactPrompt(
  loaded: { batch?: number; tokens: readonly number[] },
  seq: Nlc.LlamaContextSequence,
  continued: boolean,
): number {
  if (loaded.batch !== seq.context.batchSize) return 0;
  const n = continued ? loaded.tokens.length : loaded.tokens.length - 1;
  const now = seq.contextTokens;
  for (let i = 0; i < n; i++) if (now[i] !== loaded.tokens[i]) return 0;
  return Math.max(0, n);
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
