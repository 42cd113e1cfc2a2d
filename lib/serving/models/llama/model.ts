// A loaded GGUF: node-llama-cpp's model, its contexts and what every part of
// a LlamaModel reads (the options, the state directory, the fingerprint, the
// layout of its states). Loading it checks the file, fingerprints it and
// learns the layout of the states its own llama.cpp saves.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { NixlError } from '../../../errors';
import { loadNodeLlamaCpp } from '../node-llama-cpp';
import { makeStateDir } from '../state-dir';
import { ModelRequestError, NODE_LLAMA_CPP } from '../types';
import { stateChecksumReady } from '../state-checksum';
import { ContextPool, sequenceOf } from './contexts';
import { type LlamaModelOptions, checkOptions } from './options';
import { type LlamaStateLayout, kvGeometry, learnLayout } from './seq-state';
import { StateBuffers } from './state-buffers';
import { StateFiles } from './state-file';

// One llama.cpp binding per process and GPU setting, shared by every model it
// loads: each getLlama() makes another, which holds its backend and a
// process 'beforeExit' listener until disposed, so workers started and closed
// in one process (tests, the bench) would pile them up.
const llamas = new Map<string, Promise<Nlc.Llama>>();
export function sharedLlama(nlc: typeof Nlc, gpu: NonNullable<LlamaModelOptions['gpu']>): Promise<Nlc.Llama> {
  const key = JSON.stringify(gpu);
  let p = llamas.get(key);
  if (!p) {
    p = nlc.getLlama({ gpu, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    llamas.set(key, p);
    p.catch(() => llamas.delete(key));
  }
  return p;
}

/** Tokens of the GGUF's vocabulary, when its metadata lists them. */
export function vocabSize(model: Nlc.LlamaModel): number | undefined {
  return (model.fileInfo.metadata as { tokenizer?: { ggml?: { tokens?: readonly unknown[] } } })?.tokenizer?.ggml
    ?.tokens?.length;
}

/**
 * The most UTF-8 bytes one token of the GGUF's vocabulary stands for, at most
 * (its longest piece as the metadata spells it: a piece is never shorter
 * than the bytes it decodes to), or undefined when the metadata lists none.
 */
export function longestPieceBytes(model: Nlc.LlamaModel): number | undefined {
  const pieces = (model.fileInfo.metadata as { tokenizer?: { ggml?: { tokens?: readonly unknown[] } } })?.tokenizer
    ?.ggml?.tokens;
  if (!pieces?.length) return undefined;
  let longest = 1;
  for (const p of pieces) if (typeof p === 'string') longest = Math.max(longest, Buffer.byteLength(p));
  return longest;
}

export class LoadedLlama {
  /** The model's name: the file's, without .gguf. */
  readonly id: string;
  readonly contextSize: number;
  readonly threads: number;
  readonly pool: ContextPool;
  /** The buffers and files states move through (state-buffers.ts, state-file.ts). */
  readonly buffers: StateBuffers;
  readonly files: StateFiles;
  /** What states of this model look like, or why they cannot be checked (then a decode refuses them all). */
  layout: LlamaStateLayout | string = 'not probed yet';
  /** The contexts' batch size (learned from the probe's context). */
  batch = 0;
  /** Prompt bytes above which a prompt has more tokens than a context holds (prompt.ts refuses it untokenized). */
  readonly maxPromptBytes: number;
  #chatWrapper?: Nlc.ChatWrapper;

  private constructor(
    readonly nlc: typeof Nlc,
    readonly model: Nlc.LlamaModel,
    /** sha256 of the GGUF (sampled) and the node-llama-cpp / llama.cpp build. */
    readonly fingerprint: Buffer,
    readonly o: LlamaModelOptions,
    /** Where states go through files (state-file.ts). */
    readonly stateDir: string,
  ) {
    this.id = path.basename(o.modelPath).replace(/\.gguf$/i, '');
    const trained = model.trainContextSize;
    this.contextSize = Math.min(o.contextSize ?? 4096, trained > 0 ? trained : Number.POSITIVE_INFINITY);
    this.maxPromptBytes = this.contextSize * (longestPieceBytes(model) ?? Number.POSITIVE_INFINITY);
    const parallel = o.parallel ?? 2;
    this.threads = o.threads ?? Math.max(1, Math.floor(os.availableParallelism() / parallel));
    this.buffers = new StateBuffers(parallel);
    this.files = new StateFiles(stateDir, parallel, this.buffers);
    this.pool = new ContextPool(parallel, () =>
      model.createContext({
        contextSize: this.contextSize,
        threads: this.threads,
        sequences: 1,
        ...(o.batchSize !== undefined ? { batchSize: o.batchSize } : {}),
      }),
    );
  }

  /** Loads node-llama-cpp and the model; NIXL_ERR_NOT_SUPPORTED without node-llama-cpp, NIXL_ERR_INVALID_PARAM for a bad file. */
  static async load(o: LlamaModelOptions): Promise<LoadedLlama> {
    checkOptions(o);
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
      await stateChecksumReady();
      const llama = await sharedLlama(nlc, o.gpu ?? false);
      let model: Nlc.LlamaModel;
      try {
        model = await llama.loadModel({ modelPath: o.modelPath });
      } catch (e) {
        throw new NixlError(`cannot load ${o.modelPath}: ${(e as Error).message}`, 'NIXL_ERR_INVALID_PARAM');
      }
      const build = JSON.stringify({ nlc: NODE_LLAMA_CPP, release: llama.llamaCppRelease, gpu: llama.gpu });
      const m = new LoadedLlama(nlc, model, modelFingerprint(o.modelPath, st.size, build), o, stateDir);
      await m.#probeLayout();
      return m;
    } catch (e) {
      fs.rmSync(stateDir, { recursive: true, force: true });
      throw e;
    }
  }

  /**
   * Learns what this model's states look like: its metadata (layers, K / V
   * widths, vocabulary) and a state its own llama.cpp saves (cache types, V
   * transposition) must agree, or no state can be checked and none is loaded.
   */
  async #probeLayout(): Promise<void> {
    const geometry = kvGeometry(this.model.fileInfo.metadata);
    const nVocab = vocabSize(this.model);
    if (!geometry || !nVocab) {
      this.layout = "the GGUF's metadata does not give its KV geometry and vocabulary";
      return;
    }
    const ctx = await this.pool.acquire(new AbortController().signal);
    this.batch = ctx.batchSize;
    try {
      const seq = sequenceOf(ctx);
      await seq.evaluateWithoutGeneratingNewTokens(this.model.tokenize('probe', false).slice(0, 3));
      const probe = await this.files.save(seq);
      try {
        this.layout = learnLayout(probe, geometry, nVocab, ctx.contextSize);
      } finally {
        this.buffers.give(probe);
      }
    } catch (e) {
      this.layout = `its states are not in a layout nixl-node can check (${(e as Error).message})`;
    } finally {
      await this.pool.release(ctx);
    }
  }

  /** Whether a context keeps a request's prompt for a later one to reuse (the prefixCache option). */
  get prefixCache(): boolean {
    return this.o.prefixCache !== false;
  }

  /** Of `exact` reusable leading tokens, those a context may keep or reuse: none without the prefix cache. */
  reusable(exact: number): number {
    return this.prefixCache ? exact : 0;
  }

  /** The model's chat template, as node-llama-cpp resolves it. */
  get chatWrapper(): Nlc.ChatWrapper {
    this.#chatWrapper ??= this.nlc.resolveChatWrapper(this.model);
    return this.#chatWrapper;
  }

  /**
   * A 400 when the prompt and max_tokens do not fit the context, as vLLM
   * answers: node-llama-cpp would otherwise cut the prompt and answer
   * something else.
   */
  fits(promptTokens: number, maxTokens: number): void {
    if (promptTokens + maxTokens > this.contextSize)
      throw new ModelRequestError(
        400,
        `this model's context holds ${this.contextSize} tokens; the request needs ${promptTokens + maxTokens} ` +
          `(${promptTokens} in the prompt, ${maxTokens} to generate)`,
      );
  }

  /** Frees the contexts and the model. */
  async close(): Promise<void> {
    for (const c of this.pool.all) await c.dispose();
    await this.model.dispose();
    fs.rmSync(this.stateDir, { recursive: true, force: true });
  }
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
