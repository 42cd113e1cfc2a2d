// npm run bench [-- --json out.json] [--quick]
// Every figure is a ratio against a baseline measured in the same run.
import * as fs from 'node:fs';
import * as os from 'node:os';
import { BLOCK_SIZES, benchBandwidth } from './loopback';
import { fmtBytes } from './stats';

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  const jsonAt = args.indexOf('--json');
  const quick = args.includes('--quick');
  const machine = `${os.cpus()[0]?.model ?? 'cpu'} x${os.cpus().length}, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB, ${os.platform()} ${os.release()}`;
  console.log(`nixl-node bench on ${machine}`);

  console.log('\nREAD bandwidth, loopback engine, 64 MiB per request, ratio = engine / memcpy of the same 64 MiB');
  const bw = await benchBandwidth({ reps: quick ? 3 : 7 });
  console.log(['path'.padEnd(16), 'block'.padStart(8), 'descs'.padStart(6), 'GB/s'.padStart(7), 'memcpy'.padStart(7), 'ratio'.padStart(6)].join(' '));
  for (const r of bw) {
    console.log([r.path.padEnd(16), fmtBytes(r.blockBytes).padStart(8), String(r.descriptors).padStart(6), r.gbps.toFixed(2).padStart(7),
      r.memcpyGbps.toFixed(2).padStart(7), r.ratio.toFixed(2).padStart(6)].join(' '));
  }
  void BLOCK_SIZES;
  const result = { machine, date: new Date().toISOString(), bandwidth: bw };
  if (jsonAt >= 0) {
    fs.writeFileSync(args[jsonAt + 1], JSON.stringify(result, null, 2));
    console.log(`\nwrote ${args[jsonAt + 1]}`);
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
