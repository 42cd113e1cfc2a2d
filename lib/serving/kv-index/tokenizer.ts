// Where the proxy gets a prompt's token ids for precise routing: they must be
// the ids the workers cache under, or no block matches. The local source
// tokenizes as the synthetic model does (UTF-8 bytes; a chat as the worker
// renders it); a prompt given as token ids is taken as it is.
import { chatPrompt, tokenize } from '../models/synthetic-kv';

/** A prompt's token ids, or undefined when this source cannot tell them. */
export interface PromptTokenizer {
  tokens(body: Record<string, unknown>): number[] | undefined;
}

const isIds = (p: unknown): p is number[] =>
  Array.isArray(p) && p.length > 0 && p.every((t) => typeof t === 'number' && Number.isInteger(t) && t >= 0);

/** The synthetic model's tokenizer, as its workers run it (lib/serving/models/synthetic.ts). */
export const syntheticTokenizer: PromptTokenizer = {
  tokens(body) {
    const p = body.prompt;
    if (typeof p === 'string') return Array.from(tokenize(p));
    if (isIds(p)) return p;
    if (Array.isArray(p)) return isIds(p[0]) ? p[0] : typeof p[0] === 'string' ? Array.from(tokenize(p[0])) : undefined;
    if (Array.isArray(body.messages)) {
      try {
        return Array.from(tokenize(chatPrompt(body.messages)));
      } catch {
        return undefined;
      }
    }
    return undefined;
  },
};
