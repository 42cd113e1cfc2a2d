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

/** What node-llama-cpp generated alone. */
export interface Generation {
  text: string;
  /** What onTextChunk gave, in order (a stream's chunks). */
  chunks: string[];
  /** Tokens onToken gave (released; a held-back piece left unfinished is not). */
  tokens: number;
  /** Tokens of the prompt as evaluated (with BOS, or the chat template). */
  promptTokens: number;
  /** Tokens evaluated in all: the prompt, then every generated token but the last. */
  evaluatedTokens: number;
  finishReason: 'stop' | 'length';
  ttftMs: number;
  totalMs: number;
}

export class OneProcess {
  private constructor(
    readonly nlc: typeof Nlc,
    readonly model: Nlc.LlamaModel,
    readonly context: { contextSize: number; threads: number; batchSize?: number },
  ) {}

  static async load(
    modelPath: string,
    context: { contextSize: number; threads: number; batchSize?: number },
  ): Promise<OneProcess> {
    const nlc = await loadNodeLlamaCpp();
    const llama = await nlc.getLlama({ gpu: false, build: 'never', logLevel: nlc.LlamaLogLevel.error });
    return new OneProcess(nlc, await llama.loadModel({ modelPath }), context);
  }

  /**
   * The text node-llama-cpp generates, the chunks its onTextChunk gave, the
   * tokens it evaluated (the prompt in its first batch, then all), why it
   * stopped, and how long it took to the first token and in all (ms).
   */
  async generate(a: Ask): Promise<Generation> {
    const ctx = await this.model.createContext({ ...this.context, sequences: 1 });
    const t0 = performance.now();
    let first = 0;
    let tokens = 0;
    const chunks: string[] = [];
    const o = {
      maxTokens: a.maxTokens,
      temperature: a.temperature ?? 0,
      ...(a.seed !== undefined ? { seed: a.seed } : {}),
      ...(a.stop?.length ? { customStopTriggers: a.stop } : {}),
      onToken: (t: Nlc.Token[]) => {
        if (tokens === 0) first = performance.now() - t0;
        tokens += t.length;
      },
      onTextChunk: (c: string) => {
        if (c !== '') chunks.push(c);
      },
    };
    try {
      const seq = ctx.getSequence();
      let text: string;
      let stopReason: string;
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
        ({ responseText: text, stopReason } = await session.promptWithMeta(a.text, o));
      } else {
        const c = new this.nlc.LlamaCompletion({ contextSequence: seq });
        ({
          response: text,
          metadata: { stopReason },
        } = await c.generateCompletionWithMeta(a.text, o));
      }
      return {
        text,
        chunks,
        tokens,
        // The first batch is the prompt: all its tokens but the last are
        // input only; every later token was evaluated for its logits.
        promptTokens: seq.tokenMeter.usedInputTokens + 1,
        evaluatedTokens: seq.contextTokens.length,
        finishReason: stopReason === 'maxTokens' ? 'length' : 'stop',
        ttftMs: first,
        totalMs: performance.now() - t0,
      };
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
