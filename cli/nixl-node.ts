// The nixl-node command: info, demo, bench, sidechannel, proxy, worker.
import * as path from 'node:path';
import { run, UsageError } from './args';

const HELP = `nixl-node: NVIDIA NIXL for Node.js

Usage: nixl-node <command> [options]   (nixl-node <command> --help for its options)
  info     package version, engines compiled in, NIXL plugins, which addon build loaded
  demo     prefill -> decode KV transfer between processes, every byte checked;
           --serving: clients -> proxy -> prefill / decode workers, every answer checked
  bench    READ bandwidth, native NIXL baseline, coalescing, handshake, tracing and serving,
           as ratios to baselines of the same run
  sidechannel fetch|serve   ask a side channel for a rank's metadata, or serve synthetic metadata
  proxy    disaggregated-serving proxy: encode -> prefill -> decode workers over HTTP or ZeroMQ
  worker   a Node inference worker for the proxy: a GGUF through node-llama-cpp, a generated test
           model (tiny, small, ...) or the synthetic model
  --version  the package version
`;

const [cmd, ...rest] = process.argv.slice(2);
run(cmd ?? '', async () => {
  switch (cmd) {
    case 'info':
      return (await import('./info')).infoCommand(rest);
    case '--version':
    case '-v':
      console.log((require(path.join(__dirname, '..', '..', 'package.json')) as { version: string }).version);
      return;
    case 'demo':
      return (await import('./demo')).demoCommand(rest);
    case 'bench':
      return (await import('./bench')).benchCommand(rest);
    case 'sidechannel':
      return (await import('./sidechannel')).sidechannel(rest);
    case 'proxy':
      return (await import('./proxy')).proxyCommand(rest);
    case 'worker':
      return (await import('./worker')).workerCommand(rest);
    case undefined:
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return;
    default:
      throw new UsageError(`unknown command '${cmd}' (try nixl-node --help)`);
  }
});
