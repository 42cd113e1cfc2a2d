// What the roles (roles.ts, prefill.ts, decode.ts) are given: the worker's
// parts as objects (its blocks, its holds, its KV mode, its turns), and one
// request as the front passed it, checked and made a model's request.
import type { SpanLike } from '../../tracing';
import type { GenerationRequest, ServingModel } from '../models/types';
import type { Answer } from './answer';
import type { BlockStore } from './block-store';
import type { Sink } from './fronts/front';
import type { KvHandoff } from './handoff';
import type { HoldTable } from './holds';
import type { WorkerStats } from './stats';
import type { TestHooks } from './test-hooks';
import type { TurnKv } from './turns';

/** A worker's parts, as its roles use them. */
export interface WorkerParts {
  readonly name: string;
  readonly model: ServingModel;
  readonly stats: WorkerStats;
  readonly blocks: BlockStore;
  readonly holds: HoldTable;
  /** The KV mode, picked at start. */
  readonly handoff: KvHandoff;
  /** Bidirectional KV (bidirectionalKv), else undefined. */
  readonly turns?: TurnKv;
  readonly secret?: string;
  readonly hooks: TestHooks;
  /** Every name it answers to (vLLM --served-model-name). */
  readonly servedModelNames: readonly string[];
  /** The first: the model's name in answers and /v1/models. */
  readonly modelId: string;
}

/** One request, as a role serves it. */
export interface RoleCall {
  req: GenerationRequest;
  /** The request's body as the front passed it. */
  body: Record<string, unknown>;
  requestId: string;
  signal: AbortSignal;
  sink: Sink;
  span: SpanLike;
  answer: Answer;
  /** When it arrived (performance.now). */
  arrivedMs: number;
  /** Blocks its KV takes, when the model can say from the prompt. */
  known: number | undefined;
}
