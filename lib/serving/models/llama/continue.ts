// How a disaggregated generation splits between two sequences without
// changing a single number: node-llama-cpp's own LlamaCompletion and
// LlamaChat generate on both sides, each on a view of the real sequence.
//
// One process: LlamaCompletion evaluates the prompt P in one batch, samples
// the first token t1 from the logits of P's last token, then evaluates t1
// alone and samples t2, and so on, with one sampler (one random stream)
// throughout. It holds back tokens that are pieces of a character, counts
// them against maxTokens and leaves unfinished ones out of the text.
//
// prefill  runs LlamaCompletion (or LlamaChat) on a view whose evaluate()
//          returns as soon as the real sequence has sampled t1: the state
//          holds exactly P (evaluated in one batch, as above), t1 is known
//          and was never evaluated. (firstTokenOf)
// decode   loads that state and runs LlamaCompletion (or LlamaChat) again on
//          a view that hides P's last token: the class evaluates P's last
//          token as it always does, and the view answers t1 instead of
//          evaluating it again (llama.cpp computes a token alone with other
//          last bits than inside a batch). From t1 on, the real sequence
//          generates, and the class applies all of its own rules: held-back
//          pieces, repeat penalty, stop strings, maxTokens. (continueFrom)
//
// A seeded sampler: one process draws t1 and t2 from the same random stream;
// the decode's sampler starts at the stream's first draw. The view makes the
// real sequence evaluate t1, sample once (the draw that chose t1 in the
// prefill), erase t1 and evaluate it again at the same position, then sample
// t2 with the second draw: one token evaluated twice, the same numbers.
import type * as Nlc from 'node-llama-cpp';

/** Thrown through LlamaCompletion / LlamaChat once the prefill's sequence has sampled its first token. */
export class FirstTokenSampled extends Error {
  constructor(readonly token: Nlc.Token | undefined) {
    super('first token sampled');
    this.name = 'FirstTokenSampled';
  }
}

/**
 * A view of `seq` for the prefill: everything goes to the real sequence, but
 * the first evaluate() evaluates its input, samples one token and throws
 * FirstTokenSampled with it (nothing more is evaluated).
 */
export function firstTokenOf(seq: Nlc.LlamaContextSequence): Nlc.LlamaContextSequence {
  const evaluate = (tokens: Nlc.Token[], options?: Nlc.SequenceEvaluateOptions): AsyncIterableIterator<Nlc.Token> => {
    const it = seq.evaluate(tokens, options);
    return {
      [Symbol.asyncIterator]() {
        return this;
      },
      async next() {
        let r: IteratorResult<Nlc.Token, void>;
        try {
          r = await it.next();
        } finally {
          await it.return();
        }
        throw new FirstTokenSampled(r.done ? undefined : r.value);
      },
      async return() {
        await it.return();
        return { done: true, value: undefined };
      },
    };
  };
  return view(seq, { evaluate });
}

/** Where a decode continues: the token sampled from the state's last logits, and whether sampling drew for it. */
export interface Continuation {
  next: Nlc.Token;
  /** temperature > 0: the sampler drew once for `next` (the decode's sampler must draw once before the second token). */
  sampled: boolean;
}

/**
 * A view of `seq` (holding a loaded state) for the decode: LlamaCompletion
 * or LlamaChat sees the state without its last token, evaluates that token
 * as always, and gets `c.next` as the token it sampled. Anything else it asks
 * of a state that does not match (another prompt, a context shift) drops
 * the hidden token first and goes to the real sequence: slower, still right.
 * `used()` says whether the continuation was taken.
 */
export function continueFrom(
  seq: Nlc.LlamaContextSequence,
  c: Continuation,
): { sequence: Nlc.LlamaContextSequence; used: () => boolean } {
  let hidden = seq.contextTokens.length > 0;
  let used = false;
  const last = seq.contextTokens.at(-1);
  const visible = () => (hidden ? seq.contextTokens.slice(0, -1) : seq.contextTokens);
  /** The caller's view becomes the real sequence: the hidden token goes. */
  const drop = async () => {
    if (!hidden) return;
    hidden = false;
    await seq.eraseContextTokenRanges([{ start: seq.nextTokenIndex - 1, end: seq.nextTokenIndex }]);
  };
  const prefixOf = (tokens: readonly Nlc.Token[], of: readonly Nlc.Token[]) =>
    tokens.length >= of.length && of.every((t, i) => tokens[i] === t);

  async function adaptStateToTokens(tokens: Nlc.Token[], allowShift?: boolean): Promise<void> {
    // The call a generation makes first: keep the visible state, nothing to erase.
    if (hidden && prefixOf(tokens, visible())) return;
    await drop();
    return seq.adaptStateToTokens(tokens, allowShift);
  }

  async function* evaluate(
    tokens: Nlc.Token[],
    options?: Nlc.SequenceEvaluateOptions,
  ): AsyncGenerator<Nlc.Token, void, undefined | Nlc.Token | Nlc.Token[]> {
    if (!(hidden && tokens.length === 1 && tokens[0] === last)) {
      await drop();
      return yield* seq.evaluate(tokens, options);
    }
    // As if the hidden token had just been evaluated and c.next sampled.
    hidden = false;
    used = true;
    const replaced = yield c.next;
    const input = replaced === undefined ? [c.next] : Array.isArray(replaced) ? replaced : [replaced];
    const it = seq.evaluate(input, options);
    try {
      let r = await it.next();
      if (c.sampled && !r.done) {
        // That draw was the prefill's: evaluate the same input again at the same place for the next draw.
        await seq.eraseContextTokenRanges([{ start: seq.nextTokenIndex - input.length, end: seq.nextTokenIndex }]);
        r = await it.next(input);
      }
      while (!r.done) r = await it.next(yield r.value);
    } finally {
      await it.return();
    }
  }

  const state = {
    get nextTokenIndex() {
      return seq.nextTokenIndex - (hidden ? 1 : 0);
    },
    get contextTokens() {
      return visible();
    },
    compareContextTokens(tokens: Nlc.Token[]) {
      const v = visible();
      let i = 0;
      while (i < v.length && i < tokens.length && v[i] === tokens[i]) i++;
      return { firstDifferentIndex: i };
    },
    adaptStateToTokens,
    evaluate,
    async *evaluateWithMetadata(...a: Parameters<Nlc.LlamaContextSequence['evaluateWithMetadata']>) {
      await drop();
      return yield* seq.evaluateWithMetadata(...a);
    },
    ...Object.fromEntries(
      (
        [
          'evaluateWithoutGeneratingNewTokens',
          'controlledEvaluate',
          'eraseContextTokenRanges',
          'clearHistory',
          'saveStateToFile',
          'loadStateFromFile',
        ] as const
      ).map((m) => [
        m,
        async (...a: unknown[]) => {
          await drop();
          return (seq[m] as (...x: unknown[]) => unknown).apply(seq, a);
        },
      ]),
    ),
  };
  return { sequence: view(seq, state), used: () => used };
}

/** `seq` with some members replaced; the rest read from (and methods bound to) the real sequence. */
function view(seq: Nlc.LlamaContextSequence, over: object): Nlc.LlamaContextSequence {
  return new Proxy(seq, {
    get(target, p) {
      if (Object.hasOwn(over, p)) return Reflect.get(over, p, over);
      const v = Reflect.get(target, p, target);
      return typeof v === 'function' ? v.bind(target) : v;
    },
  });
}
