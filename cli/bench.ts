// nixl-node bench: its options (bench/run.ts runs it).
import { type GridOptions, NIXLBENCH_DEFAULTS, QUICK, sectionsHelp } from '../bench/run';
import {
  UCX_NET_DEVICES_HELP,
  UCX_NET_DEVICES_OPTION,
  UsageError,
  applyUcxNetDevices,
  parse,
  positiveInt,
} from './args';

const HELP = `nixl-node bench: the binding's and the serving house's figures, each a ratio to a baseline of the same run

Usage: nixl-node bench [options]   (or npm run bench -- [options])
  --json FILE      write the results as JSON
  --svg FILE       write a bar chart
  --quick          fewer repetitions
  --only LIST      comma-separated sections, in the order they run (default: all but those to ask for):
${sectionsHelp('                     ')}
  grid, with nixlbench's option names and defaults (--quick: steps of 4, 100 iterations, 10 warm-up):
  --start-block-size N  (4096)      --max-block-size N  (67108864)
  --start-batch-size N  (1)         --max-batch-size N  (64; nixlbench's default is 1)
  --num-iter N          (1000; blocks over 1 MiB run 1/16)   --warmup-iter N  (100)
${UCX_NET_DEVICES_HELP}`;
const GRID_ARGS = {
  'start-block-size': { type: 'string' },
  'max-block-size': { type: 'string' },
  'start-batch-size': { type: 'string' },
  'max-batch-size': { type: 'string' },
  'num-iter': { type: 'string' },
  'warmup-iter': { type: 'string' },
} as const;

function gridOptions(v: Record<string, unknown>, quick: boolean): GridOptions {
  const d = quick ? QUICK : NIXLBENCH_DEFAULTS;
  const o: GridOptions = {
    ...d,
    startBlock: positiveInt(v, 'start-block-size', d.startBlock, 1 << 30),
    maxBlock: positiveInt(v, 'max-block-size', d.maxBlock, 1 << 30),
    startBatch: positiveInt(v, 'start-batch-size', d.startBatch, 1 << 16),
    maxBatch: positiveInt(v, 'max-batch-size', d.maxBatch, 1 << 16),
    numIter: positiveInt(v, 'num-iter', d.numIter, 1e7),
    warmupIter: v['warmup-iter'] === '0' ? 0 : positiveInt(v, 'warmup-iter', d.warmupIter, 1e7),
  };
  o.maxRequestBytes = Math.max(d.maxRequestBytes, o.startBlock * o.startBatch);
  if (o.startBlock > o.maxBlock) throw new UsageError('--start-block-size must not exceed --max-block-size');
  if (o.startBatch > o.maxBatch) throw new UsageError('--start-batch-size must not exceed --max-batch-size');
  if (o.startBlock * o.startBatch > 1 << 30) throw new UsageError("the grid's first request would exceed 1 GiB");
  return o;
}

export async function benchCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    {
      json: { type: 'string' },
      svg: { type: 'string' },
      quick: { type: 'boolean' },
      only: { type: 'string' },
      ...GRID_ARGS,
      ...UCX_NET_DEVICES_OPTION,
    },
    HELP,
  );
  applyUcxNetDevices(v);
  const quick = v.quick === true;
  const only = v.only === undefined ? undefined : String(v.only).split(',');
  return (await import('../bench/run')).runBench({
    json: v.json as string | undefined,
    svg: v.svg as string | undefined,
    quick,
    only,
    grid: only?.includes('grid') ? gridOptions(v, quick) : undefined,
  });
}
