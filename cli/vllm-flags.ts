// vLLM's serve flags and VLLM_NIXL_* environment on `nixl-node worker`, so a
// vLLM command line works here: each is turned into the nixl-node option
// that does the same job (docs/coming-from-vllm.md). Where nixl-node's
// meaning differs, or a vLLM setting has none here, a note says so (the
// worker logs them in one line at start). Bad input is a NixlError with a
// code: the command prints it in one line and exits 2.
import { NixlError } from '../lib/errors';

/** The vLLM options `nixl-node worker` takes (util.parseArgs). */
export const VLLM_WORKER_OPTIONS = {
  'served-model-name': { type: 'string', multiple: true },
  'max-model-len': { type: 'string' },
  'kv-transfer-config': { type: 'string' },
  'block-size': { type: 'string' },
} as const;

export const VLLM_WORKER_HELP = `vLLM's flags (docs/coming-from-vllm.md):
  --served-model-name N [N...]  the names it answers to (first: the one it reports; default: the model's)
  --max-model-len N    tokens of each context: --context-size (1k = 1000, 1K = 1024; -1 or auto: the default)
  --kv-transfer-config JSON  kv_connector NixlConnector (pull) | NixlPushConnector (push), kv_role,
                       engine_id, kv_connector_extra_config: bidirectional_kv_xfer, decoder_kv_blocks_ttl,
                       kv_recompute_threshold, kv_lease_duration
  --block-size N       synthetic model: tokens per KV block (default 16); GGUF blocks are bytes (--block-kib)
  Environment: VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT, VLLM_NIXL_ABORT_REQUEST_TIMEOUT
`;

const bad = (message: string) => new NixlError(message, 'NIXL_ERR_INVALID_PARAM');
const unsupported = (message: string) => new NixlError(message, 'NIXL_ERR_NOT_SUPPORTED');

/**
 * vLLM's `--served-model-name a b c` (one flag, several names) as the
 * repeated flag util.parseArgs reads: the words after it up to the next option.
 */
export function expandServedModelName(argv: readonly string[]): string[] {
  const out: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    out.push(argv[i]);
    if (argv[i] !== '--served-model-name') continue;
    if (i + 1 < argv.length) out.push(argv[++i]);
    while (i + 1 < argv.length && !argv[i + 1].startsWith('-')) out.push('--served-model-name', argv[++i]);
  }
  return out;
}

/** vLLM's human-readable integers: 1k = 1000, 1K = 1024 (m / M, g / G alike); undefined for -1 or auto. */
export function maxModelLen(s: string): number | undefined {
  if (s === '-1' || s.toLowerCase() === 'auto') return undefined;
  const m = /^(\d+(?:\.\d+)?)([kKmMgG]?)$/.exec(s);
  if (!m) throw bad(`--max-model-len must be a number of tokens (e.g. 4096, 4k, 4K, auto), got '${s}'`);
  const scale: Record<string, number> = { '': 1, k: 1e3, m: 1e6, g: 1e9, K: 1 << 10, M: 1 << 20, G: 1 << 30 };
  const n = Number(m[1]) * scale[m[2]];
  if (!Number.isSafeInteger(n) || n < 1 || n > 1 << 20)
    throw bad(`--max-model-len must be a whole number of tokens from 1 to ${1 << 20}, got '${s}'`);
  return n;
}

/** What a --kv-transfer-config means here, as nixl-node options. */
export interface KvTransferConfigOptions {
  kvMode: 'pull' | 'push';
  /** kv_role as a fleet role. */
  role?: 'prefill' | 'decode' | 'both';
  /** engine_id: the agent and engine name. */
  name?: string;
  bidirectionalKv?: boolean;
  decoderKvTtlS?: number;
  kvRecomputeThreshold?: number;
  leaseS?: number;
  /** Settings that mean something else here, or nothing: one sentence each. */
  notes: string[];
}

const CONNECTORS: Record<string, 'pull' | 'push'> = { NixlConnector: 'pull', NixlPushConnector: 'push' };
const ROLES: Record<string, 'prefill' | 'decode' | 'both'> = {
  kv_producer: 'prefill',
  kv_consumer: 'decode',
  kv_both: 'both',
};
/** KVTransferConfig fields that have no job here: accepted, and a note says so. */
const IGNORED = new Set([
  'kv_buffer_device',
  'kv_buffer_size',
  'kv_rank',
  'kv_parallel_size',
  'kv_ip',
  'kv_port',
  'kv_connector_module_path',
  'kv_load_failure_policy',
  'enable_permute_local_kv',
]);

/** Parses vLLM's --kv-transfer-config JSON (vllm/config/kv_transfer.py KVTransferConfig). */
export function parseKvTransferConfig(json: string): KvTransferConfigOptions {
  let c: unknown;
  try {
    c = JSON.parse(json);
  } catch (e) {
    throw bad(`--kv-transfer-config is not JSON: ${(e as Error).message}`);
  }
  if (typeof c !== 'object' || c === null || Array.isArray(c))
    throw bad('--kv-transfer-config must be a JSON object, e.g. {"kv_connector":"NixlConnector","kv_role":"kv_both"}');
  const o = c as Record<string, unknown>;
  const connector = o.kv_connector;
  if (typeof connector !== 'string' || !(connector in CONNECTORS))
    throw unsupported(
      `--kv-transfer-config: kv_connector ${JSON.stringify(connector ?? null)} is not supported: ` +
        'nixl-node implements NixlConnector (pull) and NixlPushConnector (push)',
    );
  const out: KvTransferConfigOptions = { kvMode: CONNECTORS[connector], notes: [] };
  for (const [k, v] of Object.entries(o)) {
    if (k === 'kv_connector') continue;
    if (k === 'kv_role') {
      if (typeof v !== 'string' || !(v in ROLES))
        throw bad(
          `--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, got ${JSON.stringify(v)}`,
        );
      out.role = ROLES[v];
    } else if (k === 'engine_id') {
      if (v === null) continue;
      if (typeof v !== 'string' || !/^[\w.:-]{1,128}$/.test(v))
        throw bad(`--kv-transfer-config: engine_id must be 1 to 128 of [A-Za-z0-9_.:-], got ${JSON.stringify(v)}`);
      out.name = v;
    } else if (k === 'kv_connector_extra_config') {
      extraConfig(v, out);
    } else if (IGNORED.has(k)) {
      out.notes.push(`kv_transfer_config.${k} has no meaning here (KV blocks are host memory moved by NIXL): ignored`);
    } else {
      throw bad(`--kv-transfer-config: unknown field '${k}'`);
    }
  }
  return out;
}

/** kv_connector_extra_config: the keys nixl-node implements; the rest noted. */
function extraConfig(v: unknown, out: KvTransferConfigOptions): void {
  if (typeof v !== 'object' || v === null || Array.isArray(v))
    throw bad('--kv-transfer-config: kv_connector_extra_config must be an object');
  const seconds = (k: string, x: unknown) => {
    if (typeof x !== 'number' || !Number.isFinite(x) || x <= 0 || x > 86_400)
      throw bad(`--kv-transfer-config: kv_connector_extra_config.${k} must be seconds from 1 to 86400, got ${x}`);
    return x;
  };
  for (const [k, x] of Object.entries(v)) {
    if (k === 'bidirectional_kv_xfer') {
      if (typeof x !== 'boolean') throw bad(`--kv-transfer-config: bidirectional_kv_xfer must be true or false`);
      out.bidirectionalKv = x;
    } else if (k === 'decoder_kv_blocks_ttl') out.decoderKvTtlS = seconds(k, x);
    else if (k === 'kv_lease_duration') out.leaseS = seconds(k, x);
    else if (k === 'kv_recompute_threshold') {
      if (!Number.isSafeInteger(x) || (x as number) < 0)
        throw bad(`--kv-transfer-config: kv_recompute_threshold must be a count of tokens, got ${x}`);
      out.kvRecomputeThreshold = x as number;
    } else if (k === 'enforce_handshake_compat') {
      if (x === false) out.notes.push('enforce_handshake_compat false: nixl-node always checks the compatibility hash');
    } else if (k === 'backends') {
      if (!(Array.isArray(x) && x.length === 1 && x[0] === 'UCX'))
        out.notes.push(`backends ${JSON.stringify(x)}: nixl-node's agents use UCX (or the loopback engine)`);
    } else out.notes.push(`kv_connector_extra_config.${k} is not implemented here: ignored`);
  }
}

/**
 * Turns the vLLM flags and VLLM_NIXL_* variables among parsed worker options
 * `v` into nixl-node's (in place); returns the notes to log and the served
 * model names. A vLLM setting that contradicts the nixl-node flag given for
 * the same thing is an error.
 */
export function applyVllmFlags(
  v: Record<string, unknown>,
  env: Record<string, string | undefined>,
): { servedModelNames?: string[]; sideChannelHost?: string; notes: string[] } {
  const notes: string[] = [];
  const set = (key: string, value: string, from: string) => {
    if (v[key] !== undefined && String(v[key]) !== value)
      throw bad(`${from} says ${value} but --${key} says ${String(v[key])}: give one`);
    v[key] = value;
  };
  const names = v['served-model-name'] as string[] | undefined;
  if (names?.some((n) => n.length === 0 || n.length > 256))
    throw bad('--served-model-name: each name must be 1 to 256 characters');
  if (v['max-model-len'] !== undefined) {
    const n = maxModelLen(String(v['max-model-len']));
    if (n !== undefined) set('context-size', String(n), '--max-model-len');
    if (v.model === undefined) notes.push('--max-model-len: the synthetic model has no context limit');
  }
  if (v['block-size'] !== undefined) {
    const s = String(v['block-size']);
    if (!/^\d{1,4}$/.test(s) || Number(s) < 1)
      throw bad(`--block-size must be tokens per block, 1 to 9999, got '${s}'`);
    if (v.model !== undefined)
      notes.push('--block-size: a GGUF worker cuts its KV state into blocks of bytes (--block-kib): ignored');
  }
  if (v['kv-transfer-config'] !== undefined) {
    const c = parseKvTransferConfig(String(v['kv-transfer-config']));
    notes.push(...c.notes);
    set('kv-mode', c.kvMode, `kv_connector ${c.kvMode === 'push' ? 'NixlPushConnector' : 'NixlConnector'}`);
    if (c.name !== undefined) set('name', c.name, 'engine_id');
    if (c.role !== undefined) {
      if (v.etcd !== undefined) set('role', c.role, 'kv_role');
      else if (c.role !== 'both')
        notes.push(
          `kv_role ${c.role === 'prefill' ? 'kv_producer' : 'kv_consumer'}: every worker can prefill and decode; ` +
            "the proxy's --prefill / --decode lists give it its role (with --etcd, kv_role is its --role)",
        );
    }
    if (c.bidirectionalKv === true) v['bidirectional-kv'] = true;
    if (c.decoderKvTtlS !== undefined)
      set('decoder-kv-ttl', String(Math.ceil(c.decoderKvTtlS)), 'decoder_kv_blocks_ttl');
    if (c.kvRecomputeThreshold !== undefined)
      set('kv-recompute-threshold', String(c.kvRecomputeThreshold), 'kv_recompute_threshold');
    if (c.leaseS !== undefined) set('lease-ms', String(Math.round(c.leaseS * 1000)), 'kv_lease_duration');
  }
  const port = env.VLLM_NIXL_SIDE_CHANNEL_PORT;
  if (port !== undefined && port !== '' && v['side-channel-port'] === undefined) v['side-channel-port'] = port;
  const host = env.VLLM_NIXL_SIDE_CHANNEL_HOST || undefined;
  if (host !== undefined && !/^[\w.:[\]-]{1,253}$/.test(host))
    throw bad(`VLLM_NIXL_SIDE_CHANNEL_HOST must be a host name or address, got '${host.slice(0, 100)}'`);
  const abort = env.VLLM_NIXL_ABORT_REQUEST_TIMEOUT;
  if (abort !== undefined && abort !== '') {
    if (!/^\d{1,5}$/.test(abort) || Number(abort) < 1)
      throw bad(`VLLM_NIXL_ABORT_REQUEST_TIMEOUT must be seconds from 1 to 99999, got '${abort.slice(0, 100)}'`);
    const wire = v.wire ?? env.NIXL_WIRE ?? 'v12';
    // v0.13's prefill frees unread blocks after this timeout; v12 replaced it with the heartbeat lease.
    if (wire === 'v0.13' && v['lease-ms'] === undefined) v['lease-ms'] = String(Number(abort) * 1000);
    else
      notes.push(
        'VLLM_NIXL_ABORT_REQUEST_TIMEOUT: with the v12 wire (or --lease-ms) the prefill holds unread KV for ' +
          'its lease (kv_lease_duration / --lease-ms, 30 s, renewed by heartbeats): ignored',
      );
  }
  return { ...(names?.length ? { servedModelNames: names } : {}), ...(host ? { sideChannelHost: host } : {}), notes };
}
