// Precise routing's tokens from the workers' own GGUF, loaded in the proxy
// without its weights (models/llama/vocab.ts): the ids a worker's /tokenize
// would answer, without a round trip to a prefill that is busy evaluating.
import { loadVocab } from '../models/llama/vocab';
import { type PromptTokenizer, promptAsked } from './tokenizer';

/** A tokenizer over `modelPath`'s vocabulary and chat template; close() frees it. */
export async function ggufTokenizer(modelPath: string): Promise<PromptTokenizer & { close(): Promise<void> }> {
  const vocab = await loadVocab(modelPath);
  return {
    tokens(body) {
      const asked = promptAsked(body);
      if (asked === undefined || Array.isArray(asked)) return asked;
      // As the worker's /tokenize builds it (worker/tokenize.ts): the ids do not depend on the rest.
      const chat = 'messages' in asked;
      try {
        return vocab.promptIds({
          chat,
          prompt: chat ? '' : asked.prompt,
          messages: chat ? (asked.messages as never) : [],
          maxTokens: 1,
          temperature: 0,
          stop: [],
        });
      } catch {
        // A chat the template cannot render, or a prompt longer in bytes than any worker's context holds
        // tokens (prompt.ts: not tokenized, llama.cpp's tokenizer would hold the proxy's loop): route by load.
        return undefined;
      }
    },
    close: () => vocab.close(),
  };
}
