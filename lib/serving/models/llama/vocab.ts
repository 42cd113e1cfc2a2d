// A GGUF's vocabulary and chat template without its weights, for a router
// that must compute a prompt's token ids as the workers do (the proxy's
// precise routing). node-llama-cpp loads the model with vocabOnly: the
// tokenizer and the metadata, no tensors, in milliseconds and a few MiB.
import * as fs from 'node:fs';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { NixlError } from '../../../errors';
import { loadNodeLlamaCpp } from '../node-llama-cpp';
import type { GenerationRequest } from '../types';
import { longestPieceBytes, sharedLlama } from './model';
import { type PromptModel, promptOf } from './prompt';

/** A GGUF's vocabulary: a prompt's ids as a worker serving the same file evaluates them. */
export interface LlamaVocab {
  /** The model's name: the file's, without .gguf (as its worker names it). */
  readonly id: string;
  /** The ids of `req`'s prompt (a completion's with the BOS the model adds), or undefined for a chat that is not valid. */
  promptIds(req: GenerationRequest): number[] | undefined;
  close(): Promise<void>;
}

/** Loads `modelPath`'s vocabulary: NIXL_ERR_INVALID_PARAM for a missing or bad file, NIXL_ERR_NOT_SUPPORTED without node-llama-cpp. */
export async function loadVocab(modelPath: string): Promise<LlamaVocab> {
  if (!fs.statSync(modelPath, { throwIfNoEntry: false })?.isFile())
    throw new NixlError(`no model file ${modelPath}`, 'NIXL_ERR_INVALID_PARAM');
  const nlc = await loadNodeLlamaCpp();
  const llama = await sharedLlama(nlc, false);
  let model: Nlc.LlamaModel;
  try {
    model = await llama.loadModel({ modelPath, vocabOnly: true });
  } catch (e) {
    throw new NixlError(
      `cannot load the vocabulary of ${modelPath}: ${(e as Error).message}`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }
  let chatWrapper: Nlc.ChatWrapper | undefined;
  const m: PromptModel = {
    id: path.basename(modelPath).replace(/\.gguf$/i, ''),
    model,
    maxPromptBytes: maxPromptBytes(model),
    // Resolved as LoadedLlama resolves it: the same template gives the same ids.
    get chatWrapper() {
      chatWrapper ??= nlc.resolveChatWrapper(model);
      return chatWrapper;
    },
  };
  return {
    id: m.id,
    promptIds: (req) => promptOf(m, req),
    close: () => model.dispose(),
  };
}

/** The trained context times the longest vocabulary piece, in bytes (PromptModel.maxPromptBytes). */
function maxPromptBytes(model: Nlc.LlamaModel): number {
  const meta = model.fileInfo.metadata as { general?: { architecture?: string } } & Record<
    string,
    { context_length?: unknown } | undefined
  >;
  // A vocabulary-only load has no context: trainContextSize is 0, the metadata says it.
  const arch = meta?.general?.architecture;
  const context = Number((arch && meta[arch]?.context_length) ?? model.trainContextSize);
  const longest = longestPieceBytes(model);
  return longest !== undefined && context > 0 ? context * longest : Number.POSITIVE_INFINITY;
}
