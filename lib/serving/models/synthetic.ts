// The synthetic model behind the ServingModel boundary: no weights, every
// byte checkable (synthetic-kv.ts). A decode checks each byte of the KV it
// was given against the prompt's before it "generates".
import { SyntheticPrefixCache } from './synthetic-cache';
import {
  DEFAULT_MODEL,
  MODEL_NAME,
  type SyntheticModelSpec,
  chatPrompt,
  checkKv,
  computeKv,
  generate,
  numBlocks,
  tokenize,
} from './synthetic-kv';
import {
  type BlockView,
  type Generated,
  type GenerationRequest,
  type KvGeometry,
  type KvInput,
  KvRejected,
  type ModelTokenizer,
  type PrefilledKv,
  type PrefixCacheListener,
  type ServingModel,
  type TextSink,
  type TurnKvState,
} from './types';

/** The synthetic model behind the ServingModel boundary: no weights, every KV byte checkable. */
export class SyntheticModel implements ServingModel {
  readonly id = MODEL_NAME;
  readonly geometry: KvGeometry;
  readonly compatibilityHash: string;
  /** Token ids are the prompt's UTF-8 bytes. */
  readonly tokenizer: ModelTokenizer = {
    vocabSize: 256,
    encode: (text) => Array.from(tokenize(text)),
    decode: (ids) => Buffer.from(ids).toString('utf8'),
  };

  /** Its prefix cache: kept only while KV events watch it (it computes every block either way). */
  #cache?: SyntheticPrefixCache;

  constructor(readonly spec: SyntheticModelSpec = DEFAULT_MODEL) {
    this.geometry = { layers: spec.layers, blockBytes: spec.blockBytes, tokensPerBlock: spec.blockSize };
    this.compatibilityHash = `synthetic:${JSON.stringify(spec)}`;
  }

  #tokens(req: GenerationRequest): Uint8Array {
    if (req.promptTokens) return Uint8Array.from(req.promptTokens);
    return tokenize(req.chat ? chatPrompt(req.messages) : req.prompt);
  }

  promptTokenIds(req: GenerationRequest): number[] {
    return Array.from(this.#tokens(req));
  }

  /**
   * The tokens of the prompt followed by the answer, as the next turn's
   * prompt renders them: a completion's prompt and text, or the chat with
   * the answer as the assistant's message.
   */
  turnKv(req: GenerationRequest, text: string): TurnKvState {
    const tokens = req.promptTokens
      ? Uint8Array.from([...req.promptTokens, ...tokenize(text)])
      : tokenize(req.chat ? chatPrompt([...req.messages, { role: 'assistant', content: text }]) : req.prompt + text);
    return {
      tokens: Array.from(tokens),
      blocks: numBlocks(tokens.length, this.spec),
      writeTo: (view) => computeKv(tokens, this.spec, view),
    };
  }

  blocksFor(req: GenerationRequest): number {
    return numBlocks(this.#tokens(req).length, this.spec);
  }

  watchPrefixCache(l: (blockSize: number) => PrefixCacheListener, capacityBlocks: number): void {
    this.#cache = new SyntheticPrefixCache(l(this.spec.blockSize), this.spec.blockSize, capacityBlocks);
  }

  resetPrefixCache(): void {
    this.#cache?.clear();
  }

  async prefill(req: GenerationRequest): Promise<PrefilledKv> {
    const tokens = this.#tokens(req);
    const spec = this.spec;
    const hit = this.#cache?.prefill(Array.from(tokens));
    return {
      blocks: numBlocks(tokens.length, spec),
      promptTokens: tokens.length,
      writeTo: (view, _binding, fromBlock) => computeKv(tokens, spec, view, fromBlock),
      ...(hit !== undefined ? { info: { prefix_reused_tokens: hit } } : {}),
    };
  }

  async decode(req: GenerationRequest, kv: KvInput, out: TextSink, signal: AbortSignal): Promise<Generated> {
    const tokens = this.#tokens(req);
    const n = numBlocks(tokens.length, this.spec);
    if (kv.blocks !== n) throw new KvRejected(`the KV names ${kv.blocks} blocks; the prompt needs ${n}`, 'mismatch');
    const bad = checkKv(tokens, this.spec, kv.view);
    if (bad > 0) throw new KvRejected(`${bad} bytes of the KV differ from the prompt's`, 'mismatch', bad);
    const verified = n * this.spec.layers * this.spec.blockBytes;
    return this.#emit(req, kv, tokens.length, { out, signal, info: { verified_bytes: verified } });
  }

  async generate(req: GenerationRequest, out: TextSink, signal: AbortSignal): Promise<Generated> {
    const tokens = this.#tokens(req);
    const { spec } = this;
    const hit = this.#cache?.prefill(Array.from(tokens));
    const n = numBlocks(tokens.length, spec);
    const kv = Array.from({ length: n * spec.layers }, () => Buffer.alloc(spec.blockBytes));
    const view: BlockView = (b, l) => kv[b * spec.layers + l];
    computeKv(tokens, spec, view);
    const info = hit === undefined ? {} : { prefix_reused_tokens: hit };
    return this.#emit(req, { view, blocks: n }, tokens.length, { out, signal, info: { verified_bytes: 0, ...info } });
  }

  /**
   * Its answer: max_tokens words. A request in token ids (the generate
   * endpoint) counts in its tokenizer's tokens, bytes: the words' first
   * max_tokens bytes (ASCII), so the ids returned are what max_tokens allows.
   */
  async #emit(
    req: GenerationRequest,
    kv: KvInput,
    promptTokens: number,
    to: { out: TextSink; signal: AbortSignal; info: Record<string, unknown> },
  ): Promise<Generated> {
    const words = generate(kv.view, kv.blocks, this.spec, req.maxTokens);
    kv.blocksRead?.();
    let left = req.promptTokens ? req.maxTokens : Number.POSITIVE_INFINITY;
    for (const [i, w] of words.entries()) {
      if (to.signal.aborted || left <= 0) break;
      const piece = (i === 0 ? w : ` ${w}`).slice(0, left);
      left -= piece.length;
      to.out(piece);
      // Streamed answers go out as they come, not in one burst at the end.
      if (i % 4 === 3) await new Promise((r) => setImmediate(r));
    }
    const completionTokens = req.promptTokens ? req.maxTokens - left : words.length;
    return { completionTokens, promptTokens, finishReason: 'length', info: to.info };
  }

  /** Nothing to free. */
  async close(): Promise<void> {}
}
