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
  worker   a Node inference worker with a synthetic model, for the proxy (nixl-node worker --help)
`;

function packageRoot(): string {
  return path.join(__dirname, '..', '..');
}

async function info(argv: string[]): Promise<void> {
  const { applyUcxNetDevices, parse, UCX_NET_DEVICES_HELP, UCX_NET_DEVICES_OPTION } = await import(
    '../lib/command-args'
  );
  const v = parse(
    argv,
    { json: { type: 'boolean' }, ...UCX_NET_DEVICES_OPTION },
    `Usage: nixl-node info [--json] [--ucx-net-devices LIST]
  --json                  one JSON object: version, engines, addon, NIXL plugins, status codes, backendParams
${UCX_NET_DEVICES_HELP}`,
  );
  applyUcxNetDevices(v);
  const root = packageRoot();
  const pkg = require(path.join(root, 'package.json')) as { version: string };
  const { engines, NixlAgent } = await import('../lib');
  const { statusTable } = await import('../lib/status-table');
  const addon = process.env.NIXL_NODE_ADDON ?? (require('node-gyp-build') as { path(d: string): string }).path(root);
  const out: Record<string, unknown> = {
    version: pkg.version,
    node: process.version,
    engines,
    addon: path.relative(root, addon) || addon,
    statusCodes: statusTable().source,
    // What UCX will read when a NIXL agent first loads it (docs/nixl.md).
    ucx: Object.fromEntries(
      ['UCX_NET_DEVICES', 'UCX_TLS'].flatMap((k) => (process.env[k] === undefined ? [] : [[k, process.env[k]]])),
    ),
  };
  // Each engine's default backends, created, as they report their parameters.
  const backendParams: Record<string, unknown> = {};
  for (const engine of engines as Array<'loopback' | 'nixl'>) {
    let a: InstanceType<typeof NixlAgent> | undefined;
    try {
      a = new NixlAgent(`nixl-node-info-${engine}-${process.pid}`, { engine });
      if (engine === 'nixl') out.nixlPlugins = a.getPluginList();
      backendParams[engine] = Object.fromEntries(a.getBackends().map((b) => [b, a!.getBackendParams(b)]));
    } catch (e) {
      backendParams[engine] = { error: `${(e as { code?: string }).code ?? 'Error'}: ${(e as Error).message}` };
    } finally {
      a?.close();
    }
  }
  out.backendParams = backendParams;
  if (v.json) {
    console.log(JSON.stringify(out));
    return;
  }
  console.log(`nixl-node ${out.version} (node ${out.node})`);
  console.log(
    `  engines:  ${engines.join(', ')}${engines.includes('nixl') ? '' : ' (NIXL not compiled in: set NIXL_PREFIX and reinstall)'}`,
  );
  if (out.nixlPlugins) console.log(`  NIXL plugins: ${(out.nixlPlugins as string[]).join(', ')}`);
  console.log(`  addon:    ${out.addon}`);
  console.log(`  status codes: ${out.statusCodes}`);
  for (const [engine, backends] of Object.entries(backendParams)) {
    for (const [b, p] of Object.entries(backends as Record<string, unknown>)) {
      const text =
        typeof p === 'string'
          ? p
          : Object.entries((p as { params: Record<string, string> }).params)
              .map(([k, x]) => `${k}=${x}`)
              .join(', ');
      console.log(`  ${engine} ${b}: ${text}`);
    }
  }
}

const [cmd, ...rest] = process.argv.slice(2);
run(cmd ?? '', async () => {
  switch (cmd) {
    case 'info':
      return info(rest);
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
