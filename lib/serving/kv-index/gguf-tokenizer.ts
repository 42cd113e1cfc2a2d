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
      // Tokenizing runs on the proxy's event loop (llama.cpp's tokenizer, synchronous), and its cost grows
      // faster than the prompt (the test models' vocabulary: 0.65 s for 100 KB, 96 s for 1 MB). A prompt
      // longer than any worker's context in bytes is answered 400 wherever it goes: route it by load.
      if (promptBytes(asked) > vocab.maxPromptBytes) return undefined;
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
        return undefined; // a chat the template cannot render: route by load, as without tokens
      }
    },
    close: () => vocab.close(),
  };
}

/** UTF-8 bytes of a prompt's text: the completion's, or the text of every message (what a chat renders at least). */
function promptBytes(asked: { prompt: string } | { messages: unknown[] }): number {
  if ('prompt' in asked) return Buffer.byteLength(asked.prompt);
  let n = 0;
  for (const m of asked.messages) {
    const c = (m as { content?: unknown } | null)?.content;
    if (typeof c === 'string') n += Buffer.byteLength(c);
    else if (Array.isArray(c))
      for (const p of c) {
        const t = (p as { text?: unknown } | null)?.text;
        if (typeof t === 'string') n += Buffer.byteLength(t);
      }
  }
  return n;
}
