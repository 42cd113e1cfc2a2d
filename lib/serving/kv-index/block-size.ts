// The proxy's block size B: the tokens per key of its index, by which every
// prompt is keyed once. A worker whose block size W is a whole multiple of B
// is followed (each of its blocks is W/B keys, its match floored to whole
// blocks of W); another is refused. Given (--kv-block-size), B never
// changes. Not given, B is the greatest common divisor of the block sizes
// seen (advertised, or in a store), so that a pool whose first worker is a
// GGUF one at 512 still follows one at 16 arriving later: B goes down to
// the divisor and the index is keyed again (every worker followed again
// from a replay). Never below MIN_AUTO_BLOCK by itself: more keys per
// prompt cost every decision, and a worker's events alone could otherwise
// shrink it to 1.

/** The smallest block size the proxy goes down to without --kv-block-size (vLLM's default). */
export const MIN_AUTO_BLOCK = 16;

export function gcd(a: number, b: number): number {
  while (b !== 0) [a, b] = [b, a % b];
  return a;
}

/**
 * What to do with a worker's block size: follow it (B just set to `adopt`,
 * nothing keyed yet; or changed to `rekey`, everything keyed again), or
 * refuse it (`why`).
 */
export type Verdict = { follow: true; adopt?: number; rekey?: number } | { follow: false; why: string };

export class KeySize {
  #b: number | undefined;

  /** `given`: --kv-block-size, fixed. */
  constructor(readonly given?: number) {
    this.#b = given;
  }

  /** Tokens per key, once known. */
  get value(): number | undefined {
    return this.#b;
  }

  /** Whether a worker with blocks of `w` tokens can be followed, and at what B (the first size seen is adopted). */
  consider(w: number): Verdict {
    const b = this.#b;
    if (b === undefined) {
      this.#b = w;
      return { follow: true, adopt: w };
    }
    if (w % b === 0) return { follow: true };
    const g = gcd(b, w);
    if (this.given === undefined && g >= MIN_AUTO_BLOCK) {
      this.#b = g;
      return { follow: true, rekey: g };
    }
    const by =
      this.given !== undefined
        ? '--kv-block-size'
        : `without --kv-block-size: the divisor of the sizes it follows, never below ${MIN_AUTO_BLOCK} by itself`;
    return {
      follow: false,
      why:
        `block_size ${w} is not a multiple of the proxy's ${b} (${by}): not followed. ` +
        `The proxy follows block sizes ${b}, ${2 * b}, ${3 * b}, ...; --kv-block-size ${g} would follow this worker too`,
    };
  }
}
