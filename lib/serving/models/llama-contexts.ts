// The contexts of a GGUF model: at most `max`, made on demand, one sequence
// each; a request waits for a free one. A context is cleared between
// requests, and thrown away (and replaced) when a request may have left it in
// a state llama.cpp cannot clear: a failed state load, a failed evaluation.
// While no context can be made the pool says so (a worker's /health).
import type * as Nlc from 'node-llama-cpp';
import { ModelRequestError } from './types';

const sequences = new WeakMap<Nlc.LlamaContext, Nlc.LlamaContextSequence>();

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

  constructor(
    readonly max: number,
    readonly create: () => Promise<Nlc.LlamaContext>,
  ) {}

  /** Why no context can be made now (the last attempt failed), or undefined. */
  get broken(): string | undefined {
    return this.#broken;
  }

  async acquire(signal: AbortSignal): Promise<Nlc.LlamaContext> {
    const c = this.#free.pop();
    if (c) return c;
    if (this.#created < this.max) return this.#make();
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

  /** Gives a context back, cleared: nothing of the last request is reused. */
  async release(ctx: Nlc.LlamaContext): Promise<void> {
    try {
      await sequenceOf(ctx).clearHistory();
    } catch {
      return this.discard(ctx);
    }
    this.#hand(ctx);
  }

  /**
   * Throws a context away (a request may have left cells in it that a clear
   * does not remove) and makes another for whoever waits, so that one bad
   * request never reaches a later one.
   */
  async discard(ctx: Nlc.LlamaContext): Promise<void> {
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
