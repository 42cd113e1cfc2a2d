// nixl-node info: package version, engines compiled in, NIXL plugins, status codes, backends, the addon loaded.
import * as path from 'node:path';
import { UCX_NET_DEVICES_HELP, UCX_NET_DEVICES_OPTION, applyUcxNetDevices, parse } from './args';

function packageRoot(): string {
  return path.join(__dirname, '..', '..');
}

export async function infoCommand(argv: string[]): Promise<void> {
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
    `  engines:  ${engines.join(', ')}${engines.includes('nixl') ? '' : ' (NIXL is not compiled in: agents use the loopback engine, this host only; set NIXL_PREFIX and reinstall)'}`,
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
