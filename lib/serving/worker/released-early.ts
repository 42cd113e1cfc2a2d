// Request ids a proxy released before the work it released was made here:
// the release overtook the request (another connection, or the request was
// still running). A prefill of one gives its blocks up, and a decode of one
// holds no turn for it. A few seconds, at most 4096 ids.

/** How long a release waits for its request, ms. */
const WAIT_MS = 10_000;
const MAX = 4096;

export class ReleasedEarly {
  readonly #at = new Map<string, number>();

  /** Notes a release that found nothing of `requestId`. */
  add(requestId: string): void {
    this.#at.delete(requestId);
    this.#at.set(requestId, performance.now());
    if (this.#at.size > MAX) this.#at.delete(this.#at.keys().next().value as string);
  }

  /** Whether `requestId` was released, lately, before anything of it was made. */
  has(requestId: string): boolean {
    const t = this.#at.get(requestId);
    return t !== undefined && performance.now() - t < WAIT_MS;
  }
}
