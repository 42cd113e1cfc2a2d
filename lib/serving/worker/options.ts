// A worker's options, and the checks they pass at start, before a model
// loads or an agent is made (a bad option fails there, not on a request).
import type { EngineKind } from '../../agent';
import { NixlError } from '../../errors';
import type { WireName } from '../../handshake/model';
import { wireProfile } from '../../handshake/wire';
import type { FleetJoinOptions } from '../fleet/registry';
import type { Logger } from '../log';
import type { SyntheticModelSpec } from '../models/synthetic-kv';
import { type BlockQueueOptions, checkBlockQueueOptions } from './blocks';
import type { KvMode } from './handoff';
import { checkKvMode } from './handoff-push';
import { type KvEventsConfig, parseKvEventsConfig } from './kv-events';
import type { TestHooks } from './test-hooks';

/**
 * Options of a worker. kvWaitMs, kvQueueMax: how long and how many requests
 * wait for KV blocks when the cache is full (blocks.ts).
 */
export interface WorkerOptions extends BlockQueueOptions {
  name?: string;
  /** The names it answers to (vLLM --served-model-name); the first is the one it reports. Default: the model's. */
  servedModelNames?: string[];
  /** Interface of the side channel (vLLM VLLM_NIXL_SIDE_CHANNEL_HOST; default: host). */
  sideChannelHost?: string;
  transport?: 'http' | 'zmq';
  /** HTTP: interface and port of the API (default 127.0.0.1, any free port). */
  host?: string;
  /** HTTP port (default 0: any free port). */
  port?: number;
  /** ZMQ: the PULL address to bind (tcp://host:port, tcp://127.0.0.1:0 for any port, or ipc://path). */
  zmqAddr?: string;
  /** An HTTP port of its own for GET /metrics and /health, on host (0: any free port; default: none). */
  metricsPort?: number;
  /** Side channel of this worker's prefill KV (default: host, any free port). */
  sideChannelPort?: number;
  /** KV cache blocks (default 512). */
  blocks?: number;
  /**
   * The model: a GGUF file (needs the node-llama-cpp package), or the
   * synthetic model's shape (default).
   */
  model?: string | SyntheticModelSpec;
  /** GGUF: CPU threads of each context (default: the cores shared among `parallel`). */
  threads?: number;
  /** GGUF: tokens of each context (default 4096). */
  contextSize?: number;
  /** GGUF: requests evaluated at once, a context each (default 2). */
  parallel?: number;
  /** GGUF: tokens llama.cpp evaluates in one batch (default: the context size, at most 512). */
  batchSize?: number;
  /** GGUF: reuse a context's cached prompt prefix in whole batches (default true; the numbers do not change). */
  prefixCache?: boolean;
  /** GGUF: bytes of one KV block (default 64 KiB); a request's state takes as many as it needs. */
  blockBytes?: number;
  /**
   * GGUF: where states go through files on their way in and out of llama.cpp
   * (default: NIXL_NODE_STATE_DIR, else /dev/shm where writable, else the OS temp dir).
   */
  stateDir?: string;
  wire?: WireName;
  /** How long a prefill holds KV nobody read (default: the profile's lease, 30 s for v12). */
  leaseMs?: number;
  engine?: EngineKind;
  /** Largest request body, bytes (default 1 MiB). */
  maxBodyBytes?: number;
  /** HTTP: a request whose headers and body have not all arrived by then is cut (default 30 s). */
  requestTimeoutMs?: number;
  /**
   * A secret shared by the deployment's workers: prefills sign the
   * kv_transfer_params they return, decodes refuse unsigned or forged ones
   * (nothing read). Default: NIXL_NODE_KV_SECRET, else none (vLLM-compatible).
   */
  kvSecret?: string;
  /**
   * Where the worker logs (pino, or anything with its `(fields, message)`
   * methods): each request at debug, failed ones at warn (5xx) or info (4xx).
   * Default: nothing is logged.
   */
  logger?: Logger;
  /** Registers in etcd under a lease, so proxies given the same etcd find it (docs/fleet.md). */
  etcd?: FleetJoinOptions;
  /**
   * Bidirectional KV (vLLM bidirectional_kv_xfer; docs/multiturn.md): a
   * decode holds each answered turn's KV for the next turn's prefill and
   * returns kv_transfer_params naming it; a prefill given such params reads
   * what is provably its prompt's prefix instead of recomputing it.
   */
  bidirectionalKv?: boolean;
  /** How long a decode holds a finished turn, ms (vLLM decoder_kv_blocks_ttl: 480 s). */
  decoderKvTtlMs?: number;
  /** A prefill recomputes a previous turn's KV of fewer tokens than this (vLLM kv_recompute_threshold: 64). */
  kvRecomputeThreshold?: number;
  /** The share of the KV cache held turns may take together (default 0.5); past it a turn is not held. */
  heldTurnsShare?: number;
  /**
   * A prefill's handshake with the decode holding the previous turn: one
   * attempt of this many ms (default 1000), then it recomputes (reuse is an
   * optimisation; a dead decode must not delay the turn by the full 3 x 5 s
   * of a pull's handshake).
   */
  kvReuseHandshakeMs?: number;
  /**
   * How KV moves (docs/kv-push.md): 'pull' (default, vLLM NixlConnector) or
   * 'push' (NixlPushConnector: decodes register their blocks, prefills WRITE).
   */
  kvMode?: KvMode;
  /** Push: a decode's deadline for every WRITE, ms (default 30 s). */
  pushTimeoutMs?: number;
  /**
   * What tests do to a worker on purpose (test-hooks.ts); never set in a deployment.
   * @internal
   */
  testHooks?: TestHooks;
  /** Publishes its prefix cache as vLLM's KV events (vLLM --kv-events-config; docs/kv-events.md). */
  kvEvents?: KvEventsConfig | string;
}

/** The deployment's secret: the option, else NIXL_NODE_KV_SECRET, else none. */
export function kvSecret(o: WorkerOptions): string | undefined {
  return o.kvSecret ?? process.env.NIXL_NODE_KV_SECRET ?? undefined;
}

/** The longest wait a Node.js timer takes (longer ones fire at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Bidirectional KV's options, checked at start, before a model loads or an
 * agent is made: out of range, each decode would compute its answer and then
 * fail holding the turn (the blocks it took kept), or each prefill's
 * handshake with it time out at once.
 */
function checkTurnOptions(o: WorkerOptions): void {
  const bad = (k: string, v: unknown, what: string) =>
    new NixlError(`${k} must be ${what}, got ${v}`, 'NIXL_ERR_INVALID_PARAM');
  const ttl = o.decoderKvTtlMs;
  if (ttl !== undefined && !(Number.isFinite(ttl) && ttl > 0))
    throw bad('decoderKvTtlMs', ttl, 'a positive number of ms');
  // One timer waits for the handshake.
  const hs = o.kvReuseHandshakeMs;
  if (hs !== undefined && !(Number.isFinite(hs) && hs > 0 && hs <= MAX_TIMER_MS))
    throw bad('kvReuseHandshakeMs', hs, `a positive number of ms, at most ${MAX_TIMER_MS}`);
  const share = o.heldTurnsShare;
  if (share !== undefined && !(share >= 0 && share <= 1))
    throw new NixlError(`heldTurnsShare must be from 0 to 1, got ${share}`, 'NIXL_ERR_INVALID_PARAM');
  const t = o.kvRecomputeThreshold;
  if (t !== undefined && !(Number.isSafeInteger(t) && t >= 0))
    throw bad('kvRecomputeThreshold', t, 'a count of tokens');
}

/** Every option a worker checks at start: throws NixlError (NIXL_ERR_INVALID_PARAM, NIXL_ERR_NOT_SUPPORTED). */
export function checkOptions(o: WorkerOptions): void {
  wireProfile(o.wire); // a bad profile fails before anything starts
  checkTurnOptions(o);
  checkBlockQueueOptions(o);
  parseKvEventsConfig(o.kvEvents);
  checkKvMode(o);
}
