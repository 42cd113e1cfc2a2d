// Where the proxy gets a prompt's token ids for precise routing: they must be
// the ids the workers cache under, or no block matches. The local source
// tokenizes as the synthetic model does (UTF-8 bytes; a chat as the worker
// renders it); the worker source asks a healthy prefill's `/tokenize`
// (vLLM's endpoint), so the model's own tokenizer and chat template decide;
// the GGUF source (gguf-tokenizer.ts) loads the workers' vocabulary itself.
// A prompt given as token ids is taken as it is.
import { chatPrompt, tokenize } from '../models/synthetic-kv';

/** A prompt's token ids, or undefined when this source cannot tell them. */
export interface PromptTokenizer {
  /** The ids of a request body's prompt, as the prefill workers evaluate it. */
  tokens(body: Record<string, unknown>): number[] | undefined | Promise<number[] | undefined>;
  /** Frees what it holds (a loaded vocabulary); called by the proxy that made it. */
  close?(): Promise<void>;
}

/** Whether `p` is a prompt given as token ids (a loop, not every(): this runs on each routing decision). */
function isIds(p: unknown): p is number[] {
  if (!Array.isArray(p) || p.length === 0) return false;
  for (let i = 0; i < p.length; i++) {
    const t = p[i];
    if (typeof t !== 'number' || !Number.isInteger(t) || t < 0) return false;
  }
  return true;
}

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

/**
 * The body with only the prompt its route evaluates: a chat's messages (a
 * `prompt` beside them is ignored by the worker), a completion's prompt (not
 * `messages`). Tokenizing the other field would route on tokens no prefill computes.
 */
export function routedPrompt(path: string, body: Record<string, unknown>): Record<string, unknown> {
  const other = path === '/v1/chat/completions' ? 'prompt' : path === '/v1/completions' ? 'messages' : undefined;
  if (other === undefined || !(other in body)) return body;
  const { [other]: _, ...rest } = body;
  return rest;
}

/** What a request body prompts, as /tokenize takes it: ids as given, a text, or chat messages; undefined for neither. */
export function promptAsked(
  body: Record<string, unknown>,
): number[] | { prompt: string } | { messages: unknown[] } | undefined {
  const p = body.prompt;
  if (isIds(p)) return p;
  if (Array.isArray(p) && isIds(p[0])) return p[0];
  if (typeof p === 'string') return { prompt: p };
  if (Array.isArray(p) && typeof p[0] === 'string') return { prompt: p[0] };
  if (Array.isArray(body.messages)) return { messages: body.messages };
  return undefined;
}

/**
 * Asks a worker's `POST /tokenize` ({model, prompt} or {model, messages}) for
 * the prompt's ids; undefined (routing by load) when no worker answers in
 * time or the answer is not a list of ids. `workers`: the HTTP base URLs to
 * ask, the first that answers wins.
 */
export function workerTokenizer(workers: () => string[], timeoutMs = 1000): PromptTokenizer {
  return {
    async tokens(body) {
      const asked = promptAsked(body);
      if (asked === undefined || Array.isArray(asked)) return asked;
      const ask = { model: body.model, ...asked };
      for (const url of workers()
        .filter((u) => /^https?:\/\//.test(u))
        .slice(0, 2)) {
        try {
          const r = await fetch(`${url}/tokenize`, {
            method: 'POST',
            headers: { 'content-type': 'application/json' },
            body: JSON.stringify(ask),
            signal: AbortSignal.timeout(timeoutMs),
          });
          if (!r.ok) continue;
          const tokens = ((await r.json()) as { tokens?: unknown })?.tokens;
          if (isIds(tokens)) return tokens;
        } catch {
          // unreachable or too slow: the next, else no tokens
        }
      }
      return undefined;
    },
  };
}
