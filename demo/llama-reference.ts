// What node-llama-cpp generates for a request alone, in this process: the
// reference every disaggregated answer is checked against (demo, bench).
// LlamaCompletion for /v1/completions, LlamaChatSession for chat, each on a
// fresh context of the workers' size and thread count.
import type * as Nlc from 'node-llama-cpp';
import { loadNodeLlamaCpp } from '../lib/serving/models/node-llama-cpp';

export interface Ask {
  chat: boolean;
  /** The prompt, or the last user message of a chat. */
  text: string;
  /** Chat: the messages before it (system / user / assistant). */
  history?: Array<{ role: string; content: string }>;
  maxTokens: number;
  temperature?: number;
  seed?: number;
  stop?: string[];
}

export class OneProcess {
  private constructor(
    readonly nlc: typeof Nlc,
    readonly model: Nlc.LlamaModel,
    readonly context: { contextSize: number; threads: number },
  ) {}

  static async load(modelPath: string, context: { contextSize: number; threads: number }): Promise<OneProcess> {
    const nlc = await loadNodeLlamaCpp();
    const llama = await nlc.getLlama({ gpu: false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    return new OneProcess(nlc, await llama.loadModel({ modelPath }), context);
  }

  /** The text node-llama-cpp generates, and how long it took to the first token and in all (ms). */
  async generate(a: Ask): Promise<{ text: string; ttftMs: number; totalMs: number; tokens: number }> {
    const ctx = await this.model.createContext({ ...this.context, sequences: 1 });
    const t0 = performance.now();
    let first = 0;
    let tokens = 0;
    const o = {
      maxTokens: a.maxTokens,
      temperature: a.temperature ?? 0,
      ...(a.seed !== undefined ? { seed: a.seed } : {}),
      ...(a.stop?.length ? { customStopTriggers: a.stop } : {}),
      onToken: (t: Nlc.Token[]) => {
        if (tokens === 0) first = performance.now() - t0;
        tokens += t.length;
      },
    };
    try {
      const seq = ctx.getSequence();
      let text: string;
      if (a.chat) {
        const session = new this.nlc.LlamaChatSession({ contextSequence: seq });
        session.setChatHistory(
          (a.history ?? []).map(
            (m): Nlc.ChatHistoryItem =>
              m.role === 'assistant'
                ? { type: 'model', response: [m.content] }
                : { type: m.role === 'user' ? 'user' : 'system', text: m.content },
          ),
        );
        text = await session.prompt(a.text, o);
      } else text = await new this.nlc.LlamaCompletion({ contextSequence: seq }).generateCompletion(a.text, o);
      return { text, ttftMs: first, totalMs: performance.now() - t0, tokens };
    } finally {
      await ctx.dispose();
    }
  }

  async close(): Promise<void> {
    await this.model.dispose();
  }
}

/** The request body of an Ask. */
export function askBody(a: Ask, stream: boolean): Record<string, unknown> {
  const common = {
    max_tokens: a.maxTokens,
    temperature: a.temperature ?? 0,
    ...(a.seed !== undefined ? { seed: a.seed } : {}),
    ...(a.stop?.length ? { stop: a.stop } : {}),
    stream,
  };
  return a.chat
    ? { messages: [...(a.history ?? []), { role: 'user', content: a.text }], ...common }
    : { prompt: a.text, ...common };
}
