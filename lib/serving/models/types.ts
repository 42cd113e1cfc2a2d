// The boundary between a worker's stage logic (worker.ts) and a model: the
// synthetic one (synthetic.ts) and llama.cpp through node-llama-cpp
// (llama/). The worker owns the registered KV pool, the blocks, the pulls
// and the holds; a model only evaluates, puts its KV into blocks it is given,
// and generates from blocks it is given.
import { NixlError, type NixlErrorCode } from '../../errors';

/** The node-llama-cpp release GGUF workers are tested with (an optional peer dependency). */
export const NODE_LLAMA_CPP = 'node-llama-cpp@3.21.1';

/** One chat message as a request carries it (checked by schema.ts). */
export interface ChatMessage {
  role: string;
  content: string | Array<{ type: string; text?: string; image_url?: { url?: string } }>;
}

/** What a model needs of a /v1/completions or /v1/chat/completions request. */
export interface GenerationRequest {
  chat: boolean;
  /** /v1/completions */
  prompt: string;
  /** The prompt as token ids (generate endpoint, checked against the vocabulary): evaluated instead of `prompt`. */
  promptTokens?: readonly number[];
  /** /v1/chat/completions */
  messages: ChatMessage[];
  maxTokens: number;
  /** 0: greedy. */
  temperature: number;
  topP?: number;
  /** Sampling seed (temperature > 0): the same seed gives the same tokens. */
  seed?: number;
  /** Generation ends before any of these strings. */
  stop: string[];
  /**
   * Prefill: the tokens its decode will generate (the client's max_tokens),
   * so that a prompt that cannot fit with them is refused before evaluating.
   */
  decodeMaxTokens?: number;
  /**
   * Decode with bidirectional KV: a model whose KV the worker cannot make
   * from the text alone (GGUF) returns the answered turn's KV in
   * Generated.turn.
   */
  keepTurn?: boolean;
}

/** Block `block` (logical, 0-based within a request) of layer `layer`, in the worker's registered pool. */
export type BlockView = (block: number, layer: number) => Buffer;

/** How a model's KV lies in the worker's pool: `layers` regions of `blockBytes`-byte blocks. */
export interface KvGeometry {
  layers: number;
  blockBytes: number;
  /** Tokens one block holds (the layout's block_size; 1 block per request when a model's KV is one blob). */
  tokensPerBlock: number;
}

/**
 * The request a KV state is made for, as kv_transfer_params name it: the
 * prefill's engine, its request id, the block ids (of the prefill's pool). A
 * prefill binds its state to it; a decode refuses a state bound to another.
 */
export interface KvBinding {
  engineId: string;
  requestId: string;
  blockIds: readonly number[];
  /**
   * Push: the decode sized its blocks from its own prompt, so the state must
   * hold exactly that prompt's tokens (a model that can tell refuses another's).
   */
  ownPrompt?: boolean;
}

/** A prompt's KV, evaluated, ready to go into blocks. */
export interface PrefilledKv {
  readonly blocks: number;
  readonly promptTokens: number;
  /** Time taken to take the KV out of the model (llama: save the sequence state), ms. */
  readonly saveMs?: number;
  /** What the prefill adds under nixl_node in its answer (tokens reused from a cached prefix, tokens evaluated). */
  readonly info?: Record<string, unknown>;
  /**
   * Push: the KV is one whole that no prefix of is usable (a GGUF's state),
   * so a decode must register exactly `blocks` blocks; else fewer are a
   * prefix the decode holds already.
   */
  readonly whole?: boolean;
  /** Push: why a decode cannot have sized its blocks for this KV from the request (the prefill refuses to push it). */
  readonly unpushable?: string;
  /**
   * Writes it into the request's blocks, bound to the request (kv_transfer_params) that names them.
   * `fromBlock`: the blocks before it already hold this prompt's KV (read from a previous turn).
   */
  writeTo(view: BlockView, binding: KvBinding, fromBlock?: number): void;
  /** Given a PreviousTurn: the tokens taken from it (0: none), and why none when so. */
  readonly turn?: { reused: number; skipped?: string };
}

/** The KV of a finished turn (its prompt and answer), which a decode holds for the next turn. */
export interface TurnKvState {
  /** The token ids it is the KV of: what the next turn's prompt starts with. */
  readonly tokens: readonly number[];
  readonly blocks: number;
  /** Writes it into the blocks the decode holds it in, bound (a model that binds its states) to the hold. */
  writeTo(view: BlockView, binding: KvBinding): void;
}

/**
 * The KV a decode generates from: `blocks` blocks of `view` in the worker's
 * registered pool (pulled from a prefill, or held here), and the request
 * they are for. A model checks them before it loads a byte.
 */
export interface KvInput {
  view: BlockView;
  /** The request's blocks, 0 .. blocks - 1 of `view`. */
  blocks: number;
  /**
   * The request the kv_transfer_params named: a model that binds its states
   * refuses a state made for another, or one with no binding given.
   */
  binding?: KvBinding;
  /** Called once the model no longer reads the blocks: the worker may reuse them while the model generates. */
  blocksRead?: () => void;
}

/**
 * A previous turn's KV read whole into blocks of the prefill's pool (a model
 * whose held KV is one state, ServingModel.wholeTurnReuse): the prefill
 * takes its first `tokens` when they prove to be its prompt's.
 */
export interface PreviousTurn extends KvInput {
  /** Tokens the params proved to be the prompt's first ones (a multiple of the model's granularity). */
  tokens: number;
  /** The hold the params name: the state must be bound to it. */
  binding: KvBinding;
}

/** What a generation produced, besides its text. */
export interface Generated {
  completionTokens: number;
  promptTokens: number;
  finishReason: 'stop' | 'length';
  /** What the worker adds under nixl_node in the answer (bytes checked, tokens reused...). */
  info: Record<string, unknown>;
  /** Asked to (GenerationRequest.keepTurn): the KV the next turn may read, when the model made one. */
  turn?: TurnKvState;
}

/** Gets each piece of generated text as it comes (streamed answers). */
export type TextSink = (text: string) => void;

/**
 * A model's token ids (POST /inference/v1/generate: token ids in and out).
 * The worker turns ids into the prompt text the model evaluates and the text
 * it generates back into ids.
 */
export interface ModelTokenizer {
  /** Ids are 0 .. vocabSize - 1. */
  readonly vocabSize: number;
  /** Tokens the model's context holds (prompt and generation), when it has a limit. */
  readonly contextTokens?: number;
  /** The beginning-of-sequence id the model puts before every prompt itself, if any. */
  readonly bos?: number;
  /** The text's ids, without the beginning-of-sequence token the model adds itself. */
  encode(text: string): number[];
  /** The ids' text (a leading beginning-of-sequence token stands for nothing). */
  decode(ids: readonly number[]): string;
}

/**
 * Where a model reports what its prefix cache holds (KV events,
 * kv-events/announcer.ts): each holder (a context, a cache entry) holds the
 * full blocks of some tokens from position 0, until it holds others or none.
 */
export interface PrefixCacheListener {
  /** `owner` now holds the whole blocks of `tokens` (and nothing it held before). */
  hold(owner: unknown, tokens: readonly number[]): void;
  /** `owner` holds nothing any more. */
  drop(owner: unknown): void;
  /** Tokens of `tokens` some holder holds from its start (whole blocks). */
  cachedTokens(tokens: readonly number[]): number;
  /** Distinct blocks held. */
  readonly size: number;
}

/** What a worker needs of a model (synthetic, or a GGUF through node-llama-cpp). */
export interface ServingModel {
  /** Token ids in and out (generate endpoint); a model without one answers it 400. */
  readonly tokenizer?: ModelTokenizer;
  /** The model's name in answers and /v1/models. */
  readonly id: string;
  readonly geometry: KvGeometry;
  /** The side channel's compatibility hash: decodes refuse a prefill of another model at the handshake. */
  readonly compatibilityHash: string;
  /** Tokens a request's prompt and answer may take together, when the model has such a bound (a 400 past it). */
  readonly contextSize?: number;
  /** Blocks a prompt's KV takes when the model knows before evaluating it (a 400 before any work), else undefined. */
  blocksFor(req: GenerationRequest): number | undefined;
  /**
   * Push decode of a model whose blocksFor cannot tell: the blocks the
   * prefill's KV of this request will take, exactly (it registers them
   * before the prefill evaluates anything). Throws ModelRequestError or
   * KvRejected when it cannot.
   */
  pushBlocksFor?(req: GenerationRequest): number;
  /** The prompt's token ids (a prefill checks a previous turn's KV is of exactly its first ones). */
  promptTokenIds?(req: GenerationRequest): readonly number[];
  /**
   * The KV a decode holds after answering `req` with `text` (bidirectional
   * KV): the prompt of the next turn starts with its tokens. Undefined: the
   * model keeps none.
   */
  turnKv?(req: GenerationRequest, text: string): TurnKvState | undefined;
  /**
   * Set when a held turn's KV is one state that a prefill reads whole and
   * gives its model (prefill's `previous`), rather than blocks of tokens
   * copied in place: reused tokens are a multiple of `granularity`.
   */
  readonly wholeTurnReuse?: { granularity: number };
  /** Evaluates the prompt; `previous`: a previous turn's KV to start from (wholeTurnReuse). */
  prefill(req: GenerationRequest, signal: AbortSignal, previous?: PreviousTurn): Promise<PrefilledKv>;
  /**
   * Generates from the KV `kv` names (KvInput). Throws KvRejected, and loads
   * nothing, when the blocks do not hold this prompt's KV for this model, or
   * (a model that binds its states) hold a state made for another request.
   */
  decode(req: GenerationRequest, kv: KvInput, out: TextSink, signal: AbortSignal): Promise<Generated>;
  /** Why the model cannot serve right now (a worker's /health says so), or undefined. */
  unhealthy?(): string | undefined;
  /** Evaluates and generates here (an aggregated worker). */
  generate(req: GenerationRequest, out: TextSink, signal: AbortSignal): Promise<Generated>;
  /**
   * Reports its prefix cache's changes to `l` from now on (KV events);
   * `l` is given its reuse granularity in tokens (the events' block_size).
   * `capacityBlocks`: what a model without a cache of its own may keep.
   */
  watchPrefixCache?(l: (blockSize: number) => PrefixCacheListener, capacityBlocks: number): void;
  /** Forgets every cached prefix (no later prompt reuses one), as vLLM's prefix-cache reset. */
  resetPrefixCache?(): void;
  /** Frees the model. */
  close(): Promise<void>;
}

/** The NixlError code of each KvRejected reason. */
const REJECTED_CODES: Record<string, NixlErrorCode> = {
  truncated: 'NIXL_ERR_INVALID_PARAM',
  malformed: 'NIXL_ERR_INVALID_PARAM',
  oversized: 'NIXL_ERR_INVALID_PARAM',
  corrupted: 'NIXL_ERR_MISMATCH',
  'foreign-model': 'NIXL_ERR_MISMATCH',
  'wrong-request': 'NIXL_ERR_MISMATCH',
  mismatch: 'NIXL_ERR_MISMATCH',
  unauthenticated: 'NIXL_ERR_NOT_ALLOWED',
  version: 'NIXL_ERR_NOT_SUPPORTED',
  unsupported: 'NIXL_ERR_NOT_SUPPORTED',
  refused: 'NIXL_ERR_BACKEND',
};

/**
 * The KV a decode was given is not what it must be: nothing was loaded from
 * it (or, reason 'refused', llama.cpp refused it and the context it touched
 * was thrown away). A NixlError whose `code` follows the reason.
 */
export class KvRejected extends NixlError {
  constructor(
    message: string,
    /**
     * truncated | malformed | oversized (what the bytes say does not fit) ·
     * corrupted | foreign-model | wrong-request | mismatch (not this model's,
     * this request's or this prompt's KV) · unauthenticated (no HMAC, or a
     * wrong one, with a KV secret) · version | unsupported · refused (llama.cpp)
     */
    readonly reason: string,
    /** Synthetic model: how many bytes differ. */
    readonly badBytes = 0,
  ) {
    super(message, REJECTED_CODES[reason] ?? 'NIXL_ERR_INVALID_PARAM');
    this.name = 'KvRejected';
  }
}

/** A request this model cannot serve (a 4xx naming why). */
export class ModelRequestError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
    this.name = 'ModelRequestError';
  }
}
