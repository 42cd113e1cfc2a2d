// nixl-node bench: its options (bench/run.ts runs it).
import { parse } from './args';

const HELP = `nixl-node bench: bandwidth, native NIXL baseline, coalescing and handshake latency, as ratios to baselines of the same run

Usage: nixl-node bench [options]   (or npm run bench -- [options])
  --json FILE      write the results as JSON
  --svg FILE       write a bar chart
  --quick          fewer repetitions
  --only LIST      comma-separated: bandwidth,native,coalesce,handshake,tracing,serving (default all;
                   native: against a C++ program on the installed NIXL, when NIXL is compiled in;
                   serving: a generated llama GGUF through node-llama-cpp, when it is installed)
`;
export async function benchCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    { json: { type: 'string' }, svg: { type: 'string' }, quick: { type: 'boolean' }, only: { type: 'string' } },
    HELP,
  );
  return (await import('../bench/run')).runBench({
    json: v.json as string | undefined,
    svg: v.svg as string | undefined,
    quick: v.quick === true,
    only: v.only === undefined ? undefined : String(v.only).split(','),
  });
}
