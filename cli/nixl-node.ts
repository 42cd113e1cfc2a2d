// The nixl-node command: info, demo, bench, sidechannel, proxy, worker.
import * as path from 'node:path';
import { run, UsageError } from '../lib/command-args';

const HELP = `nixl-node: NVIDIA NIXL for Node.js

Usage: nixl-node <command> [options]
  info     package version, engines compiled in, NIXL plugins, which addon build loaded
  demo     disaggregated prefill -> decode KV transfer between processes (nixl-node demo --help)
  bench    bandwidth and handshake benchmarks (nixl-node bench --help)
  sidechannel fetch|serve   ask a side channel for a rank's metadata, or serve synthetic metadata
  proxy    disaggregated-serving proxy: encode -> prefill -> decode workers (nixl-node proxy --help)
  worker   a Node inference worker for the proxy: a GGUF model through node-llama-cpp, or the
           synthetic one (nixl-node worker --help)
  --version  the package version
`;

function packageRoot(): string {
  return path.join(__dirname, '..', '..');
}

async function info(argv: string[]): Promise<void> {
  const { parse } = await import('../lib/command-args');
  const v = parse(argv, { json: { type: 'boolean' } }, 'Usage: nixl-node info [--json]\n');
  const root = packageRoot();
  const pkg = require(path.join(root, 'package.json')) as { version: string };
  const { engines, NixlAgent } = await import('../lib');
  const addon = process.env.NIXL_NODE_ADDON ?? (require('node-gyp-build') as { path(d: string): string }).path(root);
  const out: Record<string, unknown> = {
    version: pkg.version,
    node: process.version,
    engines,
    addon: path.relative(root, addon) || addon,
  };
  if (engines.includes('nixl')) {
    const a = new NixlAgent(`nixl-node-info-${process.pid}`, { engine: 'nixl', backends: [] });
    try {
      out.nixlPlugins = a.getPluginList();
    } finally {
      a.close();
    }
  }
  if (v.json) {
    console.log(JSON.stringify(out));
    return;
  }
  console.log(`nixl-node ${out.version} (node ${out.node})`);
  console.log(
    `  engines:  ${engines.join(', ')}${engines.includes('nixl') ? '' : ' (NIXL is not compiled in: agents use the loopback engine, this host only; set NIXL_PREFIX and reinstall)'}`,
  );
  if (out.nixlPlugins) console.log(`  NIXL plugins: ${(out.nixlPlugins as string[]).join(', ')}`);
  console.log(`  addon:    ${out.addon}`);
}

const [cmd, ...rest] = process.argv.slice(2);
run(cmd ?? '', async () => {
  switch (cmd) {
    case 'info':
      return info(rest);
    case '--version':
    case '-v':
      console.log((require(path.join(packageRoot(), 'package.json')) as { version: string }).version);
      return;
    case 'demo':
      return (await import('../demo/run')).runDemo(rest);
    case 'bench':
      return (await import('../bench/run')).runBench(rest);
    case 'sidechannel':
      return (await import('./sidechannel')).sidechannel(rest);
    case 'proxy':
      return (await import('./serving')).proxyCommand(rest);
    case 'worker':
      return (await import('./serving')).workerCommand(rest);
    case undefined:
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return;
    default:
      throw new UsageError(`unknown command '${cmd}' (try nixl-node --help)`);
  }
});
