// nixl-node demo [--serving]: the options of the two demos (demo/run.ts,
// demo/serving.ts), with the bench's native baseline passed to the KV demo.
import type { DemoOptions, ProgressThreadMode } from '../demo/run';
import { engines } from '../lib';
import {
  UCX_NET_DEVICES_HELP,
  UCX_NET_DEVICES_OPTION,
  UsageError,
  applyUcxNetDevices,
  oneOf,
  parse,
  positiveInt,
} from './args';

const HELP = `nixl-node demo: disaggregated prefill -> decode KV-cache transfer

Usage: nixl-node demo [options]   (or npm run demo -- [options]); --x=y works too

  --prefill-tp N   prefill tensor-parallel size (default 2)
  --decode-tp N    decode tensor-parallel size (default 4)
  --layers N       model layers; K and V make 2 regions each (default 32)
  --blocks N       KV blocks per rank (default 256)
  --block-kib N    bytes of one block of one layer's K (or V), all heads, KiB (default 64)
  --heads N        KV heads (default 8)
  --requests N     requests the blocks are split into (default 16)
  --in-flight N    pulls in flight per decode rank (default 4)
  --rounds N       rounds of requests over the same prefill blocks (default 3): the first reads
                   the prefill's pages for the first time, the later ones as a cache in service
  --method M       handshake: zmq | http (default zmq, or NIXL_HANDSHAKE_METHOD)
  --engine E       loopback | nixl (default: nixl if compiled in)
  --progress-thread W
                   nixl: the agents that run NIXL's own progress thread: prefill (default), both or
                   none; the engine's poll thread progresses the others (a decode rank only reads);
                   see docs/benchmarks.md#the-demo-on-nixl
  --no-progress-thread
                   the same as --progress-thread none
  --mla            MLA: one latent cache per layer, replicated on every rank
  --json FILE      also write what ran and was measured as JSON (the bench's demo row reads it)
${UCX_NET_DEVICES_HELP}  --serving        the serving demo instead: clients -> proxy -> workers (nixl-node demo --serving --help)
`;

const ARGS = {
  'prefill-tp': { type: 'string' },
  'decode-tp': { type: 'string' },
  layers: { type: 'string' },
  blocks: { type: 'string' },
  'block-kib': { type: 'string' },
  heads: { type: 'string' },
  requests: { type: 'string' },
  'in-flight': { type: 'string' },
  rounds: { type: 'string' },
  method: { type: 'string' },
  engine: { type: 'string' },
  'progress-thread': { type: 'string' },
  'no-progress-thread': { type: 'boolean' },
  mla: { type: 'boolean' },
  json: { type: 'string' },
  ...UCX_NET_DEVICES_OPTION,
} as const;

function progressThreadMode(v: Record<string, unknown>): ProgressThreadMode {
  if (v['no-progress-thread'] !== true)
    return oneOf(v, 'progress-thread', ['prefill', 'both', 'none'] as const, 'prefill');
  if (v['progress-thread'] !== undefined && v['progress-thread'] !== 'none')
    throw new UsageError(`--no-progress-thread contradicts --progress-thread ${String(v['progress-thread'])}`);
  return 'none';
}

function nonEmpty(s: string, name: string): string {
  if (s === '') throw new UsageError(`${name} needs a file name`);
  return s;
}

export function parseDemoArgs(argv: string[]): DemoOptions {
  const v = parse(argv, ARGS, HELP);
  applyUcxNetDevices(v); // the workers inherit it
  const envMethod = process.env.NIXL_HANDSHAKE_METHOD;
  const o: DemoOptions = {
    prefillTp: positiveInt(v, 'prefill-tp', 2, 64),
    decodeTp: positiveInt(v, 'decode-tp', 4, 64),
    layers: positiveInt(v, 'layers', 32, 4096),
    blocks: positiveInt(v, 'blocks', 256),
    blockKib: positiveInt(v, 'block-kib', 64),
    heads: positiveInt(v, 'heads', 8, 4096),
    requests: positiveInt(v, 'requests', 16),
    inFlight: positiveInt(v, 'in-flight', 4, 1024),
    rounds: positiveInt(v, 'rounds', 3, 100),
    method: oneOf(v, 'method', ['zmq', 'http'] as const, envMethod === 'http' ? 'http' : 'zmq'),
    engine: oneOf(
      v,
      'engine',
      ['loopback', 'nixl'] as const,
      (process.env.NIXL_NODE_ENGINE as 'nixl' | 'loopback') ?? (engines.includes('nixl') ? 'nixl' : 'loopback'),
    ),
    progressThread: progressThreadMode(v),
    mla: v.mla === true,
    json: v.json === undefined ? undefined : nonEmpty(String(v.json), '--json'),
  };
  return o;
}

const SERVING_HELP = `nixl-node demo --serving: clients -> proxy -> prefill / decode workers (processes), KV over nixl-node

Usage: nixl-node demo --serving [options]   (or npm run demo -- --serving [options])
  --requests N      concurrent client requests (default 64)
  --transport T     proxy to workers: http | zmq (default http)
  --prefill N       prefill workers (default 2)
  --decode N        decode workers (default 2)
  --max-tokens N    words (tokens, with --model) each answer generates (default 16)
  --model M         a GGUF (needs node-llama-cpp), or tiny | small (generated test models):
                    answers checked against node-llama-cpp alone in this process
  --threads N       --model: CPU threads of each worker context and of the reference (default 1)
  --json            the last line is a JSON summary
${UCX_NET_DEVICES_HELP}`;

export async function demoCommand(argv: string[]): Promise<void> {
  if (argv.includes('--serving')) {
    const v = parse(
      argv.filter((a) => a !== '--serving'),
      {
        requests: { type: 'string' },
        transport: { type: 'string' },
        prefill: { type: 'string' },
        decode: { type: 'string' },
        'max-tokens': { type: 'string' },
        model: { type: 'string' },
        threads: { type: 'string' },
        json: { type: 'boolean' },
        ...UCX_NET_DEVICES_OPTION,
      },
      SERVING_HELP,
    );
    applyUcxNetDevices(v); // the workers inherit it
    const { runServingDemo } = await import('../demo/serving');
    return runServingDemo({
      model: v.model === undefined ? undefined : String(v.model),
      threads: positiveInt(v, 'threads', 1, 1024),
      requests: positiveInt(v, 'requests', 64, 100_000),
      transport: oneOf(v, 'transport', ['http', 'zmq'] as const, 'http'),
      prefill: positiveInt(v, 'prefill', 2, 64),
      decode: positiveInt(v, 'decode', 2, 64),
      maxTokens: positiveInt(v, 'max-tokens', 16, 4096),
      json: v.json === true,
    });
  }
  const o = parseDemoArgs(argv);
  return (await import('../demo/run')).runDemo(o);
}
