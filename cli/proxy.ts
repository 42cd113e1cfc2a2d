// nixl-node proxy: the disaggregated-serving proxy as a command that runs until
// killed. It prints one JSON line on stdout when ready, so scripts can wait for
// it, and logs JSON lines (pino) on stderr.
import type { WireName } from '../lib/handshake/model';
import { startProxy } from '../lib/serving';
import { oneOf, parse, positiveInt, UsageError, untilSignal } from './args';
import { startTracing } from './otel';
import { commandLogger, logLevel } from './log';
import { etcdOptions, inUse, list, port } from './serving-args';
import { parseEventEndpoint } from '../lib/serving/kv-index/precise';

/** --kv-tokenizer gguf:PATH: the workers' model file. */
function ggufPath(p: string): string {
  if (!p) throw new UsageError('--kv-tokenizer gguf:PATH wants the path of the GGUF the prefill workers serve');
  return p;
}

/** --kv-events-endpoint (repeatable), --kv-block-size and --kv-tokenizer. */
function kvEventsOptions(v: Record<string, unknown>) {
  const specs = (v['kv-events-endpoint'] as unknown as string[] | undefined) ?? [];
  const endpoints: Record<string, { pub: string; replay?: string }> = {};
  for (const s of specs) {
    try {
      const [worker, ep] = parseEventEndpoint(s);
      endpoints[worker] = ep;
    } catch (e) {
      throw new UsageError((e as Error).message);
    }
  }
  const blockSize = v['kv-block-size'] === undefined ? undefined : positiveInt(v, 'kv-block-size', 16, 4096);
  const t = v['kv-tokenizer'];
  const tokenizer =
    typeof t === 'string' && t.startsWith('gguf:')
      ? { gguf: ggufPath(t.slice('gguf:'.length)) }
      : oneOf(v, 'kv-tokenizer', ['local', 'worker'] as const, 'local');
  return specs.length > 0 || blockSize || v['kv-tokenizer'] ? { endpoints, blockSize, tokenizer } : undefined;
}

const PROXY_HELP = `nixl-node proxy: route each request through encode, prefill and decode workers

Usage: nixl-node proxy --prefill A[,B...] --decode A[,B...] [options]
       nixl-node proxy --etcd URL[,URL...] [options]
  --host H             interface to bind (default 127.0.0.1)
  --port P             port (default 8000; 0: any free port)
  --transport T        http (workers are OpenAI servers: URLs) | zmq (workers' PULL addresses)
  --prefill LIST       prefill workers, comma-separated
  --decode LIST        decode workers
  --encode LIST        encoder workers (requests with images go there first)
  --pd-addrs LIST      zmq: workers that do both prefill and decode (vLLM's name)
  --encode-addrs LIST  zmq: encoder workers (vLLM's name)
  --etcd LIST          etcd endpoints: also route to the workers registered there, as they come and go
  --etcd-prefix P      key prefix of the fleet (default /nixl-node/)
  --policy P           round-robin (default without --etcd) | least-outstanding | load (reported
                       load, free blocks, prefix affinity) | precise (the default with --etcd: the
                       prefill whose KV events say it holds the longest run of the prompt's blocks,
                       with load; the events of every prefill that advertises them are followed)
  --kv-events-endpoint WORKER=PUB[,REPLAY][,topic=T]  (repeatable) where a prefill worker (as given to
                       --prefill) publishes vLLM KV events (ZMQ PUB, its replay ROUTER, and the topic
                       its messages carry when a PUB carries several), over what it advertises;
                       docs/kv-events.md
  --kv-block-size N    precise: tokens per key of the index; a prefill whose block size is a multiple of N
                       is followed (default: the greatest common divisor of the prefills' block sizes,
                       down to 16)
  --kv-tokenizer T     precise: local (the synthetic model's, default) | worker (a prefill's /tokenize) |
                       gguf:PATH (the prefills' GGUF: its vocabulary and chat template loaded here)
  --affinity-chars N   load: prompt characters whose hash picks the prefill (default 512; 0: none)
  --timeout-ms N       per stage (default 60000)
  --health-ms N        between health checks (default 2000)
  --retries N          other prefill workers to try when one fails (default 1)
  --token T            require Authorization: Bearer T
  --max-conversations N  multi-turn: conversation_ids whose last turn's KV it remembers (default 10000)
  --conversation-ttl N   seconds it remembers one when the decode does not say (default 450)
  --wire W             v12 | v0.13: the kv_transfer_params the prefills return (default NIXL_WIRE, else v12)
  --kv-mode M          pull | push: the decode READs the KV after the prefill answers (default), or both
                       legs go at once and the prefill WRITEs into the decode's blocks (docs/kv-push.md)
  --otlp-endpoint URL  export traces to URL/v1/traces (OTLP/HTTP JSON; default OTEL_EXPORTER_OTLP_ENDPOINT)
  --log-level L        trace | debug | info | warn | error | silent (default info, or NIXL_NODE_LOG_LEVEL):
                       JSON lines on stderr: each request, workers unhealthy, ejected, back, models that differ
`;

export async function proxyCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    {
      host: { type: 'string' },
      port: { type: 'string' },
      transport: { type: 'string' },
      prefill: { type: 'string' },
      decode: { type: 'string' },
      encode: { type: 'string' },
      'pd-addrs': { type: 'string' },
      'encode-addrs': { type: 'string' },
      policy: { type: 'string' },
      'kv-events-endpoint': { type: 'string', multiple: true },
      'kv-block-size': { type: 'string' },
      'kv-tokenizer': { type: 'string' },
      etcd: { type: 'string' },
      'etcd-prefix': { type: 'string' },
      'affinity-chars': { type: 'string' },
      'timeout-ms': { type: 'string' },
      'health-ms': { type: 'string' },
      'max-conversations': { type: 'string' },
      'conversation-ttl': { type: 'string' },
      retries: { type: 'string' },
      token: { type: 'string' },
      wire: { type: 'string' },
      'kv-mode': { type: 'string' },
      'otlp-endpoint': { type: 'string' },
      'log-level': { type: 'string' },
    },
    PROXY_HELP,
  );
  const log = commandLogger('proxy', logLevel(v));
  const stopTracing = startTracing(v['otlp-endpoint'] as string | undefined, 'nixl-node-proxy', log);
  const transport = oneOf(v, 'transport', ['http', 'zmq'] as const, 'http');
  const pd = list(v, 'pd-addrs');
  const prefill = [...list(v, 'prefill'), ...pd];
  const decode = [...list(v, 'decode'), ...pd];
  const etcd = etcdOptions(v);
  if (!etcd && (prefill.length === 0 || decode.length === 0))
    throw new UsageError('give prefill and decode workers (--prefill and --decode, or --pd-addrs), or --etcd');
  const affinity = v['affinity-chars'] === '0' ? 0 : positiveInt(v, 'affinity-chars', 512, 1 << 20);
  const timeout = positiveInt(v, 'timeout-ms', 60_000, 3_600_000);
  const proxy = await startProxy({
    host: v.host as string | undefined,
    port: port(v, 8000),
    transport,
    prefill,
    decode,
    encode: [...list(v, 'encode'), ...list(v, 'encode-addrs')],
    etcd,
    policy: oneOf(
      v,
      'policy',
      ['round-robin', 'least-outstanding', 'load', 'precise'] as const,
      etcd ? 'precise' : 'round-robin',
    ),
    kvEvents: kvEventsOptions(v),
    routing: { prefixChars: affinity },
    timeoutMs: { encode: timeout, prefill: timeout, decode: timeout },
    healthIntervalMs: positiveInt(v, 'health-ms', 2000, 3_600_000),
    prefillRetries: v.retries === '0' ? 0 : positiveInt(v, 'retries', 1, 64),
    bearerToken: v.token as string | undefined,
    conversations: {
      max: positiveInt(v, 'max-conversations', 10_000, 1 << 24),
      ttlMs: positiveInt(v, 'conversation-ttl', 450, 86_400) * 1000,
    },
    wire: oneOf(v, 'wire', ['v12', 'v0.13'] as const, (process.env.NIXL_WIRE as WireName) ?? 'v12'),
    kvMode: oneOf(v, 'kv-mode', ['pull', 'push'] as const, 'pull'),
    logger: log,
  }).catch((e) => {
    throw inUse(e, '--host / --port');
  });
  const stop = untilSignal(); // before the ready line: a supervisor may signal the moment it reads it
  log.info({ url: proxy.url, transport }, 'proxy ready');
  console.log(
    JSON.stringify({ ready: true, url: proxy.url, transport, prefill, decode, etcd: etcd && proxy.fleet?.connected }),
  );
  await stop;
  await proxy.close();
  await stopTracing();
  console.log(JSON.stringify({ stopped: true, ...proxy.stats }));
}
