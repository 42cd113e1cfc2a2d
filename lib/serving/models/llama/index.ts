// A GGUF model through node-llama-cpp (llama.cpp), behind the ServingModel
// boundary. node-llama-cpp is an optional peer dependency, imported only
// here, when a worker is given a GGUF. This class is the boundary only; each
// job has a file of its own, as node-llama-cpp splits its LlamaContext/:
//   model.ts       the shared binding, load, fingerprint, layout probe
//   prompt.ts      a request's prompt as the classes render and tokenize it
//   run.ts         generation through node-llama-cpp's classes
//   kv.ts          prefill and decode through the KV in blocks
//   envelope.ts    a state in its envelope: sealed, opened and checked
//   turn.ts        multi-turn: a previous turn's KV in, the next turn's out
//   state-file.ts  states in and out of llama.cpp through files (slots used again)
//   state-buffers.ts  the buffers states move through, used again
//   contexts.ts, prefix.ts, continue.ts, push.ts, seq-state.ts, text.ts
// Each request has a context of its own (a pool of `parallel` contexts, one
// sequence each), so that nothing another request evaluates changes this
// one's numbers. A prefill or generation reuses the prompt an earlier request
// left in its context as far as that changes no number: whole batches of the
// common prefix (prefix.ts).
//
// Types only (erased): the declarations this file emits name nothing of
// node-llama-cpp, so an application without it still type-checks against
// the package.
import type {
  Generated,
  GenerationRequest,
  KvGeometry,
  KvInput,
  ModelTokenizer,
  PrefilledKv,
  PrefixCacheListener,
  PreviousTurn,
  ServingModel,
  TextSink,
} from '../types';
import { decode, prefill, pushBlocksFor } from './kv';
import { LoadedLlama } from './model';
import type { LlamaModelOptions } from './options';
import { promptOfAnyLength, tokenizerOf } from './prompt';
import { generate } from './run';
import type { LlamaStateLayout } from './seq-state';

export type { LlamaModelOptions } from './options';

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
  readonly #m: LoadedLlama;
  #tokenizer?: ModelTokenizer;

  private constructor(m: LoadedLlama) {
    this.#m = m;
    this.id = m.id;
    this.fingerprint = m.fingerprint;
    this.geometry = { layers: 1, blockBytes: m.o.blockBytes, tokensPerBlock: 16 };
    this.compatibilityHash = `llama:${m.fingerprint.toString('hex')}`;
    this.contextSize = m.contextSize;
    this.threads = m.threads;
  }

  /** Loads node-llama-cpp and the model; NIXL_ERR_NOT_SUPPORTED without node-llama-cpp, NIXL_ERR_INVALID_PARAM for a bad file. */
  static async load(o: LlamaModelOptions): Promise<LlamaModel> {
    return new LlamaModel(await LoadedLlama.load(o));
  }

  /** The GGUF's vocabulary (generate endpoint: token ids in and out). */
  get tokenizer(): ModelTokenizer | undefined {
    this.#tokenizer ??= tokenizerOf(this.#m);
    return this.#tokenizer;
  }

  /** KV events: the whole batches its contexts keep (none without the prefix cache: nothing is reused then). */
  watchPrefixCache(l: (blockSize: number) => PrefixCacheListener): void {
    const m = this.#m;
    if (m.prefixCache) m.pool.listener = l(m.batch || (m.o.batchSize ?? 512));
  }

  resetPrefixCache(): void {
    this.#m.pool.forgetPrefixes();
  }

  /** What this model's states must look like (a decode parses each against it), or why none can be checked. */
  get stateLayout(): LlamaStateLayout | string {
    return this.#m.layout;
  }

  /**
   * A held turn is one sequence state, read whole: its first whole batches
   * that a prompt starts with are loaded, and the rest evaluated from a batch
   * boundary, which changes no number (turn.ts).
   */
  get wholeTurnReuse(): { granularity: number } {
    return { granularity: this.#m.batch };
  }

  /** Why this model cannot serve now (no context can be made), or undefined. */
  unhealthy(): string | undefined {
    return this.#m.pool.broken;
  }

  /** Contexts thrown away because a request may have left them unusable. */
  get discardedContexts(): number {
    return this.#m.pool.discarded;
  }

  /** The tokens the prompt evaluates as (a prefill proves a previous turn's KV is of its first ones); none for a bad chat. */
  promptTokenIds(req: GenerationRequest): readonly number[] {
    return promptOfAnyLength(this.#m, req) ?? [];
  }

  blocksFor(): undefined {
    return undefined; // the state's size is known once it is evaluated
  }

  /** Push decode: the blocks of the state a prefill saves for this prompt, computed from its tokens (push.ts). */
  pushBlocksFor(req: GenerationRequest): number {
    return pushBlocksFor(this.#m, req);
  }

  prefill(req: GenerationRequest, signal: AbortSignal, previous?: PreviousTurn): Promise<PrefilledKv> {
    return prefill(this.#m, req, signal, previous);
  }

  decode(req: GenerationRequest, kv: KvInput, out: TextSink, signal: AbortSignal): Promise<Generated> {
    return decode(this.#m, req, kv, out, signal);
  }

  generate(req: GenerationRequest, out: TextSink, signal: AbortSignal): Promise<Generated> {
    return generate(this.#m, req, out, signal);
  }

  /** Frees the contexts and the model. */
  close(): Promise<void> {
    return this.#m.close();
  }
}
