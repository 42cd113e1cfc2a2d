// A proxy stage's abort signal: the client's, or the stage's time being up.
// AbortSignal.timeout and AbortSignal.any did the same with a timer and a
// signal each that Node tracks for their lifetime (weak refs, transferable
// wrappers): a measurable share of the proxy's CPU per request. One
// controller, one unref'd timer and one listener, undone when the stage ends.

/** Aborts `signal` when `client` aborts or after `ms`; `aborted` says the time ran out. */
export class StageTimeout {
  readonly #ac = new AbortController();
  readonly #client: AbortSignal;
  readonly #timer: NodeJS.Timeout;
  readonly #onClient = () => this.#ac.abort(this.#client.reason);
  #timedOut = false;

  constructor(client: AbortSignal, ms: number) {
    this.#client = client;
    this.#timer = setTimeout(() => {
      this.#timedOut = true;
      this.#ac.abort(new DOMException('The operation was aborted due to timeout', 'TimeoutError'));
    }, ms);
    this.#timer.unref();
    if (client.aborted) this.#ac.abort(client.reason);
    else client.addEventListener('abort', this.#onClient, { once: true });
  }

  /** The stage's signal. */
  get signal(): AbortSignal {
    return this.#ac.signal;
  }

  /** The stage's time ran out (not the client going away). */
  get aborted(): boolean {
    return this.#timedOut;
  }

  /** The stage is over: ends its span; no timer, no listener left on the client's signal. */
  end(span: { end(): void }): void {
    span.end();
    clearTimeout(this.#timer);
    this.#client.removeEventListener('abort', this.#onClient);
  }
}
