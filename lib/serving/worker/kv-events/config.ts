// vLLM's KVEventsConfig (--kv-events-config '<json>'): the same keys, the
// same defaults, the same bind-or-connect rule, so a worker line reads as a
// vLLM one. Unknown keys are refused (a typo would silently publish nothing).
import { NixlError } from '../../../errors';
import { DEFAULT_HASH_SEED } from './block-hash';

/** The options of a worker's KV events, as vLLM names them (plus the encoding and hash seed). */
export interface KvEventsConfig {
  enable_kv_cache_events?: boolean;
  /** "zmq" when enabled, else "null" (vLLM's default). */
  publisher?: 'zmq' | 'null';
  /** The PUB socket: bound when it has `*`, `::`, ipc:// or inproc://, else connected (vLLM's rule). */
  endpoint?: string;
  /** The replay ROUTER, always bound; null: no replay. */
  replay_endpoint?: string | null;
  /** Batches kept for replay. */
  buffer_steps?: number;
  /** The PUB socket's send high-water mark. */
  hwm?: number;
  /** vLLM's in-process queue bound: accepted for compatibility (batches are sent as they are made). */
  max_queue_size?: number;
  /** The first frame of every message. */
  topic?: string;
  /** "map" (vLLM >= #42892, default) or "array" (positional, vLLM <= 0.23). */
  encoding?: 'map' | 'array';
  /** The sha256_cbor chain's seed (PYTHONHASHSEED in vLLM; default "vllm-none-hash"). */
  hash_seed?: string;
}

/** A config with every default filled in. */
export interface KvEventsSettings {
  enabled: boolean;
  publisher: 'zmq' | 'null';
  endpoint: string;
  replayEndpoint: string | null;
  bufferSteps: number;
  hwm: number;
  maxQueueSize: number;
  topic: string;
  encoding: 'map' | 'array';
  hashSeed: string;
}

const KEYS = new Set([
  'enable_kv_cache_events',
  'publisher',
  'endpoint',
  'replay_endpoint',
  'buffer_steps',
  'hwm',
  'max_queue_size',
  'topic',
  'encoding',
  'hash_seed',
]);

function bad(msg: string): NixlError {
  return new NixlError(`--kv-events-config: ${msg}`, 'NIXL_ERR_INVALID_PARAM');
}

function count(o: Record<string, unknown>, k: string, dflt: number, min: number): number {
  const v = o[k] ?? dflt;
  if (!Number.isSafeInteger(v) || (v as number) < min)
    throw bad(`'${k}' must be an integer >= ${min}, not ${String(v)}`);
  return v as number;
}

function text(o: Record<string, unknown>, k: string, dflt: string): string {
  const v = o[k] ?? dflt;
  if (typeof v !== 'string') throw bad(`'${k}' must be a string`);
  return v;
}

/** Whether vLLM binds this PUB endpoint (else it connects to a collector that binds). */
export function bindsEndpoint(endpoint: string): boolean {
  return /\*|::/.test(endpoint) || endpoint.startsWith('ipc://') || endpoint.startsWith('inproc://');
}

/** Reads a config (the JSON text of --kv-events-config, or its object), filling vLLM's defaults. */
export function parseKvEventsConfig(c: string | KvEventsConfig | undefined): KvEventsSettings {
  let o: unknown = c ?? {};
  if (typeof o === 'string')
    try {
      o = JSON.parse(o);
    } catch (e) {
      throw bad(`not JSON: ${(e as Error).message}`);
    }
  if (o === null || typeof o !== 'object' || Array.isArray(o)) throw bad('must be a JSON object');
  const r = o as Record<string, unknown>;
  for (const k of Object.keys(r)) if (!KEYS.has(k)) throw bad(`unknown key '${k.slice(0, 40)}'`);
  const enabled = r.enable_kv_cache_events ?? false;
  if (typeof enabled !== 'boolean') throw bad("'enable_kv_cache_events' must be a boolean");
  const publisher = r.publisher ?? (enabled ? 'zmq' : 'null');
  if (publisher !== 'zmq' && publisher !== 'null') throw bad(`'publisher' must be "zmq" or "null"`);
  const replay = r.replay_endpoint ?? null;
  if (replay !== null && (typeof replay !== 'string' || replay === ''))
    throw bad("'replay_endpoint' must be an address or null");
  const encoding = r.encoding ?? 'map';
  if (encoding !== 'map' && encoding !== 'array') throw bad(`'encoding' must be "map" or "array"`);
  const endpoint = text(r, 'endpoint', 'tcp://*:5557');
  if (!/^(tcp|ipc|inproc):\/\/./.test(endpoint)) throw bad(`'endpoint' must be a tcp://, ipc:// or inproc:// address`);
  return {
    enabled,
    publisher,
    endpoint,
    replayEndpoint: replay as string | null,
    bufferSteps: count(r, 'buffer_steps', 10_000, 1),
    hwm: count(r, 'hwm', 100_000, 0),
    maxQueueSize: count(r, 'max_queue_size', 100_000, 1),
    topic: text(r, 'topic', ''),
    encoding,
    hashSeed: text(r, 'hash_seed', DEFAULT_HASH_SEED),
  };
}
