// Prefix reuse that changes no number. node-llama-cpp keeps a sequence's
// tokens; LlamaCompletion and LlamaChat evaluate a prompt that starts with
// them from the first token that differs (adaptStateToTokens). llama.cpp
// computes a token's K / V with other last bits depending on the batch it
// was evaluated in (its size, where it starts): a prefix evaluated for an
// earlier prompt, cut anywhere, makes states that differ from a fresh
// evaluation's, and answers may differ where two tokens nearly tie.
//
// A fresh evaluation goes in batches of the context's batchSize B from
// position 0: [0, B), [B, 2B), ... So a prefix of whole batches, each
// evaluated whole, at the same positions, after the same tokens, holds the
// very numbers a fresh evaluation computes, and evaluating the rest from a
// multiple of B batches it as a fresh evaluation does. The view below lets
// the class reuse exactly that: the common prefix, cut down to a multiple of
// B and to what is known to have been evaluated that way (`exact`), the rest
// erased before the class evaluates it.
import type * as Nlc from 'node-llama-cpp';

/** Tokens a prompt can take from `cached` without changing a number: the common prefix, in whole batches of what is exact. */
export function reusableTokens(
  cached: readonly Nlc.Token[],
  exact: number,
  tokens: readonly Nlc.Token[],
  batch: number,
): number {
  const limit = Math.min(exact, cached.length, tokens.length);
  let i = 0;
  while (i < limit && cached[i] === tokens[i]) i++;
  return i - (i % batch);
}

/** A sequence that reuses what it may of its cached prefix, and what it did. */
export interface Reusing {
  sequence: Nlc.LlamaContextSequence;
  /** Tokens of the prompt taken from the cache (0 when none). */
  reused(): number;
  /** Tokens of the sequence a later prompt may reuse now (whole batches of this prompt, evaluated as a fresh one would). */
  exactAfter(): number;
}

const EVALUATIONS = [
  'evaluate',
  'evaluateWithMetadata',
  'evaluateWithoutGeneratingNewTokens',
  'controlledEvaluate',
] as const;

/**
 * A view of `seq` (whose first `exact` tokens were evaluated in whole
 * batches from position 0) for one generation by LlamaCompletion or
 * LlamaChat.
 */
export function reusing(seq: Nlc.LlamaContextSequence, exact: number): Reusing {
  const batch = seq.context.batchSize;
  let reused = 0;
  let promptEnd: number | undefined;
  let lowest = Number.POSITIVE_INFINITY; // the lowest position erased after the prompt's evaluation began
  const erase = async (start: number) => {
    if (start < seq.nextTokenIndex) await seq.eraseContextTokenRanges([{ start, end: seq.nextTokenIndex }]);
  };
  const over: Record<string, unknown> = {
    // The classes call this (allowShift false) with the prompt but its last token before evaluating.
    async adaptStateToTokens(tokens: Nlc.Token[]) {
      if (promptEnd === undefined) {
        reused = reusableTokens(seq.contextTokens, exact, tokens, batch);
        return erase(reused);
      }
      // Again during the generation (LlamaChat re-aligning): as node-llama-cpp would, noting what goes.
      const { firstDifferentIndex } = seq.compareContextTokens(tokens);
      lowest = Math.min(lowest, firstDifferentIndex);
      return erase(firstDifferentIndex);
    },
    async eraseContextTokenRanges(ranges: Nlc.ContextTokensDeleteRange[]) {
      if (promptEnd !== undefined) for (const r of ranges) lowest = Math.min(lowest, r.start);
      else exact = Math.min(exact, ...ranges.map((r) => r.start));
      return seq.eraseContextTokenRanges(ranges);
    },
    async clearHistory() {
      if (promptEnd !== undefined) lowest = 0;
      exact = 0;
      return seq.clearHistory();
    },
  };
  for (const m of EVALUATIONS) {
    over[m] = (tokens: unknown[], ...rest: unknown[]) => {
      if (promptEnd === undefined) {
        const start = seq.nextTokenIndex;
        // Whole batches from a batch boundary that follows exact tokens only; anything else is exact up to its start.
        promptEnd = start % batch === 0 && start <= exact ? start + tokens.length : Math.min(start, exact);
        if (start < reused) reused = start;
      }
      return (seq[m] as (...a: unknown[]) => unknown).call(seq, tokens, ...rest);
    };
  }
  return {
    sequence: new Proxy(seq, {
      get(target, p) {
        if (Object.hasOwn(over, p)) return over[p as string];
        const v = Reflect.get(target, p, target);
        return typeof v === 'function' ? v.bind(target) : v;
      },
    }),
    reused: () => reused,
    exactAfter: () => {
      const end =
        promptEnd === undefined ? Math.min(exact, seq.nextTokenIndex) : Math.min(promptEnd, lowest, seq.nextTokenIndex);
      return end - (end % batch);
    },
  };
}
