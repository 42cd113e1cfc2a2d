// nixl-node worker: a Node inference worker (a GGUF through node-llama-cpp, a
// generated test model, or the synthetic model) as a command that runs until
// killed. It prints one JSON line on stdout when ready, so scripts can wait for
// it, and logs JSON lines (pino) on stderr.
import type { WireName } from '../lib/handshake/model';
import { startWorker } from '../lib/serving';
import { modelPath } from '../lib/serving/models/test-models';
import type { TestHooks } from '../lib/serving/worker/test-hooks';
import { DEFAULT_REUSE_HANDSHAKE_MS } from '../lib/serving/worker/turns';
import {
  applyUcxNetDevices,
  oneOf,
  parse,
  positiveInt,
  UCX_NET_DEVICES_HELP,
  UCX_NET_DEVICES_OPTION,
  UsageError,
  untilSignal,
} from './args';
import { engines } from '../lib/agent';
import { startTracing } from './otel';
import { commandLogger, logLevel } from './log';

import { etcdOptions, inUse, integer, port, portNumber } from './serving-args';
import { applyVllmFlags, expandServedModelName, VLLM_WORKER_HELP, VLLM_WORKER_OPTIONS } from './vllm-flags';
import { DEFAULT_MODEL } from '../lib/serving/models/synthetic-kv';

const WORKER_HELP = `nixl-node worker: a Node inference worker: a GGUF model (llama.cpp) or the synthetic one

Usage: nixl-node worker [options]
  --model M            a GGUF file (needs node-llama-cpp: npm i -E node-llama-cpp@3.21.1), or
                       tiny | small | tiny-utf8 | tiny-unbiased (generated test models); default: the synthetic model
  --threads N          GGUF: CPU threads of each context (default: the cores shared among --parallel)
  --context-size N     GGUF: tokens of each context (default 4096)
  --parallel N         GGUF: requests evaluated at once, one context each (default 2)
  --batch-size N       GGUF: tokens evaluated in one batch (default: the context size, at most 512)
  --no-prefix-cache    GGUF: never reuse a cached prompt prefix (by default whole batches of it are reused)
  --block-kib N        GGUF: KiB of one KV block (default 64)
  --state-dir D        GGUF: where states go through files (default NIXL_NODE_STATE_DIR, else /dev/shm, else $TMPDIR)
  --name N             agent and engine name (default worker-<pid>-<random>)
  --transport T        http | zmq (default http)
  --host H             interface (default 127.0.0.1)
  --port P             HTTP port (default 0: any free port)
  --zmq-addr A         zmq: PULL address to bind (default tcp://<host>:<any port>)
  --metrics-port P     an HTTP port of its own on --host for GET /metrics and /health (0: any free port;
                       default none): how a zmq worker is scraped; an http worker serves both on --port too
  --side-channel-port P  port of its prefill side channel (default 0: any free port)
  --blocks N           KV cache blocks (default 512)
  --kv-events-config J vLLM's KVEventsConfig as JSON: publish the prefix cache's blocks as vLLM's KV events
                       (ZeroMQ PUB + replay; keys and defaults as vLLM's; docs/kv-events.md)
  --lease-ms N         how long a prefill holds KV nobody read (default: the wire profile's, 30 s)
  --kv-wait-ms N       how long a request waits for KV blocks while the cache is full, in order, before a
                       503 kv_cache_full with Retry-After (default 30000; 0: refuse at once)
  --kv-queue-max N     requests that may wait for blocks at once; past it a 503 kv_queue_full (default 1024)
  --wire W             v12 | v0.13 (default NIXL_WIRE, else v12)
  --kv-mode M          pull | push: how this worker's KV moves, as vLLM's NixlConnector or NixlPushConnector
                       (default pull; every worker behind one proxy uses the proxy's --kv-mode)
  --kv-secret S        sign / require signed kv_transfer_params (default NIXL_NODE_KV_SECRET)
  --bidirectional-kv   multi-turn: a decode holds each answered turn's KV for the next turn's prefill,
                       which reads what is provably its prompt's prefix (vLLM bidirectional_kv_xfer)
  --decoder-kv-ttl N   seconds a decode holds a finished turn (default 480, vLLM decoder_kv_blocks_ttl)
  --kv-recompute-threshold N  a prefill recomputes a previous turn of fewer tokens than N (default 64)
  --kv-reuse-handshake-timeout MS  a prefill's one handshake attempt with the decode holding the previous
                       turn, ms, before it recomputes instead (default 1000)
  --etcd LIST          register in etcd (endpoints, comma-separated) under a lease; needs etcd3
  --etcd-prefix P      key prefix of the fleet (default /nixl-node/)
  --role R             prefill | decode | both | encode: the proxies' pools it joins (default both)
  --etcd-ttl N         lease seconds: how long it stays listed after dying (default 5)
  --otlp-endpoint URL  export traces to URL/v1/traces (OTLP/HTTP JSON; default OTEL_EXPORTER_OTLP_ENDPOINT)
  --log-level L        trace | debug | info | warn | error | silent (default info, or NIXL_NODE_LOG_LEVEL):
                       JSON lines on stderr; each request at debug, failed ones at info / warn
${UCX_NET_DEVICES_HELP}
${VLLM_WORKER_HELP}`;

export async function workerCommand(argv: string[]): Promise<void> {
  const v = parse(
    expandServedModelName(argv),
    {
      name: { type: 'string' },
      transport: { type: 'string' },
      host: { type: 'string' },
      port: { type: 'string' },
      'zmq-addr': { type: 'string' },
      'metrics-port': { type: 'string' },
      blocks: { type: 'string' },
      'lease-ms': { type: 'string' },
      'kv-wait-ms': { type: 'string' },
      'kv-queue-max': { type: 'string' },
      wire: { type: 'string' },
      'kv-mode': { type: 'string' },
      'stall-prefill-ms': { type: 'string' },
      'stall-decode-ms': { type: 'string' },
      'side-channel-port': { type: 'string' },
      'kv-secret': { type: 'string' },
      'bidirectional-kv': { type: 'boolean' },
      'decoder-kv-ttl': { type: 'string' },
      'kv-recompute-threshold': { type: 'string' },
      'kv-reuse-handshake-timeout': { type: 'string' },
      'otlp-endpoint': { type: 'string' },
      'poison-freed': { type: 'boolean' },
      'clock-skew-ms': { type: 'string' },
      model: { type: 'string' },
      threads: { type: 'string' },
      'context-size': { type: 'string' },
      parallel: { type: 'string' },
      'batch-size': { type: 'string' },
      'no-prefix-cache': { type: 'boolean' },
      'kv-events-config': { type: 'string' },
      'block-kib': { type: 'string' },
      'state-dir': { type: 'string' },
      'tamper-kv': { type: 'string' },
      ...UCX_NET_DEVICES_OPTION,
      etcd: { type: 'string' },
      'etcd-prefix': { type: 'string' },
      role: { type: 'string' },
      'etcd-ttl': { type: 'string' },
      'log-level': { type: 'string' },
      ...VLLM_WORKER_OPTIONS,
    },
    WORKER_HELP,
  );
  applyUcxNetDevices(v);
  const vllm = applyVllmFlags(v, process.env);
  const log = commandLogger('worker', logLevel(v));
  if (vllm.notes.length)
    log.info({ vllm_flags: vllm.notes }, `vLLM settings that differ here: ${vllm.notes.join('; ')}`);
  const gguf = v.model === undefined ? undefined : modelPath(String(v.model));
  const optional = (name: string, max: number) => (v[name] === undefined ? undefined : positiveInt(v, name, 1, max));
  const stopTracing = startTracing(v['otlp-endpoint'] as string | undefined, 'nixl-node-worker', log);
  const etcd = etcdOptions(v);
  if (!etcd && (v.role !== undefined || v['etcd-ttl'] !== undefined))
    throw new UsageError('--role and --etcd-ttl go with --etcd');
  const w = await startWorker({
    name: v.name as string | undefined,
    transport: oneOf(v, 'transport', ['http', 'zmq'] as const, 'http'),
    host: v.host as string | undefined,
    port: port(v, 0),
    zmqAddr: v['zmq-addr'] as string | undefined,
    metricsPort: v['metrics-port'] === undefined ? undefined : portNumber(String(v['metrics-port']), 'metrics-port'),
    blocks: positiveInt(v, 'blocks', 512, 1 << 20),
    leaseMs: v['lease-ms'] === undefined ? undefined : positiveInt(v, 'lease-ms', 30_000, 86_400_000),
    kvWaitMs: v['kv-wait-ms'] === undefined ? undefined : integer(String(v['kv-wait-ms']), 'kv-wait-ms'),
    kvQueueMax: v['kv-queue-max'] === undefined ? undefined : integer(String(v['kv-queue-max']), 'kv-queue-max'),
    wire: oneOf(v, 'wire', ['v12', 'v0.13'] as const, (process.env.NIXL_WIRE as WireName) ?? 'v12'),
    sideChannelPort:
      v['side-channel-port'] === undefined
        ? undefined
        : portNumber(String(v['side-channel-port']), 'side-channel-port'),
    kvSecret: v['kv-secret'] as string | undefined,
    kvMode: oneOf(v, 'kv-mode', ['pull', 'push'] as const, 'pull'),
    ...bidirectionalOptions(v),
    model:
      gguf ?? (v['block-size'] === undefined ? undefined : { ...DEFAULT_MODEL, blockSize: Number(v['block-size']) }),
    servedModelNames: vllm.servedModelNames,
    sideChannelHost: vllm.sideChannelHost,
    threads: optional('threads', 1024),
    contextSize: optional('context-size', 1 << 20),
    parallel: optional('parallel', 256),
    batchSize: optional('batch-size', 1 << 20),
    prefixCache: v['no-prefix-cache'] !== true,
    kvEvents: v['kv-events-config'] as string | undefined,
    blockBytes: v['block-kib'] === undefined ? undefined : positiveInt(v, 'block-kib', 64, 1 << 20) * 1024,
    stateDir: v['state-dir'] as string | undefined,
    etcd: etcd && {
      ...etcd,
      role: oneOf(v, 'role', ['prefill', 'decode', 'both', 'encode'] as const, 'both'),
      ttlSec: positiveInt(v, 'etcd-ttl', 5, 3600),
    },
    testHooks: testHooks(v),
    logger: log,
  }).catch((e) => {
    throw inUse(e, '--host, --port, --side-channel-port, --zmq-addr or --metrics-port');
  });
  if (!process.env.NIXL_NODE_ENGINE && !engines.includes('nixl'))
    log.info({ engine: 'loopback' }, 'NIXL is not compiled in: the loopback engine moves KV on this host only');
  // Handlers before the ready line: a supervisor may signal the moment it reads it.
  const stop = untilSignal();
  // Stats on request (SIGUSR2), so a supervisor can read them without stopping the worker.
  process.on('SIGUSR2', () => console.log(JSON.stringify({ stats: w.stats, freeBlocks: w.freeBlocks })));
  // `name` is the logger's (nixl-node-worker): the worker's own name goes under `worker`.
  const fleet = w.fleet && { etcd: w.fleet.key, etcd_registered: w.fleet.registered };
  const metrics = w.metricsUrl && { metrics_url: w.metricsUrl };
  log.info({ worker: w.name, address: w.address, model: w.modelId, ...metrics, ...fleet }, 'worker ready');
  console.log(
    JSON.stringify({
      ready: true,
      name: w.name,
      address: w.address,
      model: w.modelId,
      served_model_names: w.servedModelNames,
      ...metrics,
      ...w.kvEvents?.health(),
      ...fleet,
    }),
  );
  await stop;
  const stats = { ...w.stats };
  await w.close();
  await stopTracing();
  console.log(JSON.stringify({ stopped: true, stats }));
}

/** --bidirectional-kv and the options that go with it. */
function bidirectionalOptions(v: Record<string, unknown>) {
  const on = v['bidirectional-kv'] === true;
  const withIt = ['decoder-kv-ttl', 'kv-recompute-threshold', 'kv-reuse-handshake-timeout'];
  if (!on && withIt.some((k) => v[k] !== undefined))
    throw new UsageError(
      '--decoder-kv-ttl, --kv-recompute-threshold and --kv-reuse-handshake-timeout go with --bidirectional-kv',
    );
  if (!on) return {};
  return {
    bidirectionalKv: true,
    decoderKvTtlMs: positiveInt(v, 'decoder-kv-ttl', 480, 86_400) * 1000,
    kvRecomputeThreshold:
      v['kv-recompute-threshold'] === '0' ? 0 : positiveInt(v, 'kv-recompute-threshold', 64, 1 << 20),
    kvReuseHandshakeMs: positiveInt(v, 'kv-reuse-handshake-timeout', DEFAULT_REUSE_HANDSHAKE_MS, 600_000),
  };
}

/**
 * The test hooks' flags (test-hooks.ts): tests start workers with them; --help leaves them out.
 * --stall-prefill-ms N, --stall-decode-ms N, --poison-freed, --clock-skew-ms N,
 * --tamper-kv truncate | corrupt | oversize | foreign.
 */
function testHooks(v: Record<string, unknown>): TestHooks {
  return {
    stallPrefillMs: v['stall-prefill-ms'] === undefined ? undefined : positiveInt(v, 'stall-prefill-ms', 0, 3_600_000),
    stallDecodeMs: v['stall-decode-ms'] === undefined ? undefined : positiveInt(v, 'stall-decode-ms', 0, 3_600_000),
    poisonFreed: v['poison-freed'] === true,
    clockSkewMs: v['clock-skew-ms'] === undefined ? undefined : integer(String(v['clock-skew-ms']), 'clock-skew-ms'),
    tamperKv:
      v['tamper-kv'] === undefined
        ? undefined
        : oneOf(v, 'tamper-kv', ['truncate', 'corrupt', 'oversize', 'foreign'] as const, 'corrupt'),
  };
}
