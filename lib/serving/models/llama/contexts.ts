// The contexts of a GGUF model: at most `max`, made on demand, one sequence
// each; a request waits for a free one. A context keeps the prompt a request
// left in it when that prompt can be reused exactly (prefix.ts), and
// is cleared otherwise; a request takes the free context whose cache shares
// the longest reusable prefix with its prompt. A context is thrown away (and
// replaced) when a request may have left it in a state llama.cpp cannot
// clear: a failed state load, a failed evaluation. While no context can be
// made the pool says so (a worker's /health).
import type * as Nlc from 'node-llama-cpp';
import { reusableTokens } from './prefix';
import { ModelRequestError, type PrefixCacheListener } from '../types';

const sequences = new WeakMap<Nlc.LlamaContext, Nlc.LlamaContextSequence>();
/** Leading tokens of a context's sequence a later prompt may reuse (evaluated in whole batches from 0). */
const exactTokens = new WeakMap<Nlc.LlamaContext, number>();

/** Leading tokens of the context's sequence that a prompt may reuse without changing a number. */
export function exactOf(ctx: Nlc.LlamaContext): number {
  return exactTokens.get(ctx) ?? 0;
}

/** The one sequence of a context. */
export function sequenceOf(ctx: Nlc.LlamaContext): Nlc.LlamaContextSequence {
  let s = sequences.get(ctx);
  if (!s) {
    s = ctx.getSequence();
    sequences.set(ctx, s);
  }
  return s;
}

export class ContextPool {
  readonly #free: Nlc.LlamaContext[] = [];
  readonly #waiters: Array<{ resolve: (c: Nlc.LlamaContext) => void; reject: (e: Error) => void }> = [];
  #created = 0;
  #broken: string | undefined;
  readonly all: Nlc.LlamaContext[] = [];
  /** Contexts thrown away since the start. */
  discarded = 0;
  /** Told which whole batches each free context keeps (KV events): a context taken or thrown away keeps none. */
  listener?: PrefixCacheListener;

  constructor(
    readonly max: number,
    readonly create: () => Promise<Nlc.LlamaContext>,
  ) {}

  /** Why no context can be made now (the last attempt failed), or undefined. */
  get broken(): string | undefined {
    return this.#broken;
  }

  /**
   * A context: of the free ones, the one that can reuse the most of `prompt`
   * (the tokens the request will evaluate); without such a one a free one
   * that caches nothing, a new one while fewer than `max` exist, else the
   * one free the longest.
   */
  async acquire(signal: AbortSignal, prompt?: readonly Nlc.Token[]): Promise<Nlc.LlamaContext> {
    const ctx = await this.#take(signal, prompt);
    this.listener?.drop(ctx);
    return ctx;
  }

  async #take(signal: AbortSignal, prompt?: readonly Nlc.Token[]): Promise<Nlc.LlamaContext> {
    let best = -1;
    let most = 0;
    if (prompt)
      this.#free.forEach((ctx, i) => {
        const n = reusableTokens(sequenceOf(ctx).contextTokens, exactOf(ctx), prompt, ctx.batchSize);
        if (n > most) [best, most] = [i, n];
      });
    if (best < 0) best = this.#free.findIndex((ctx) => exactOf(ctx) === 0);
    if (best >= 0) return this.#free.splice(best, 1)[0];
    if (this.#created < this.max) return this.#make();
    const c = this.#free.shift();
    if (c) return c;
    return new Promise((resolve, reject) => {
      const w = {
        resolve: (ctx: Nlc.LlamaContext) => {
          signal.removeEventListener('abort', onAbort);
          resolve(ctx);
        },
        reject: (e: Error) => {
          signal.removeEventListener('abort', onAbort);
          reject(e);
        },
      };
      const onAbort = () => {
        this.#waiters.splice(this.#waiters.indexOf(w), 1);
        reject(new ModelRequestError(499, 'aborted while waiting for a context'));
      };
      signal.addEventListener('abort', onAbort, { once: true });
      this.#waiters.push(w);
    });
  }

  async #make(): Promise<Nlc.LlamaContext> {
    this.#created++;
    try {
      const ctx = await this.create();
      this.all.push(ctx);
      this.#broken = undefined;
      return ctx;
    } catch (e) {
      this.#created--;
      this.#broken = `cannot create a llama.cpp context: ${(e as Error).message}`;
      throw e;
    }
  }

  /**
   * Gives a context back: with `exact` > 0 its sequence is kept, and that
   * many leading tokens may be reused; else it is cleared.
   */
  async release(ctx: Nlc.LlamaContext, exact = 0): Promise<void> {
    exactTokens.set(ctx, exact);
    if (exact <= 0)
      try {
        await sequenceOf(ctx).clearHistory();
      } catch {
        return this.discard(ctx);
      }
    else this.listener?.hold(ctx, sequenceOf(ctx).contextTokens.slice(0, exact));
    this.#hand(ctx);
  }

  /** Makes the free contexts' kept prompts unusable (a prefix-cache reset); busy ones keep what they make. */
  forgetPrefixes(): void {
    for (const ctx of this.#free) exactTokens.set(ctx, 0);
  }

  /**
   * Throws a context away (a request may have left cells in it that a clear
   * does not remove) and makes another for whoever waits, so that one bad
   * request never reaches a later one.
   */
  async discard(ctx: Nlc.LlamaContext): Promise<void> {
    this.listener?.drop(ctx);
    this.discarded++;
    this.#created--;
    this.all.splice(this.all.indexOf(ctx), 1);
    sequences.delete(ctx);
    await ctx.dispose().catch(() => {});
    if (this.#waiters.length === 0) return;
    try {
      this.#hand(await this.#make());
    } catch (e) {
      // #broken says why; the next acquire tries again. Nobody is left to hand one back.
      if (this.#created === 0) for (const w of this.#waiters.splice(0)) w.reject(e as Error);
    }
  }

  #hand(ctx: Nlc.LlamaContext): void {
    const w = this.#waiters.shift();
    if (w) w.resolve(ctx);
    else this.#free.push(ctx);
  }
}
