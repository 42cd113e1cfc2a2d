// nixl-node info: package version, engines compiled in, NIXL plugins, the addon build loaded.
import * as path from 'node:path';
import { parse } from './args';

function packageRoot(): string {
  return path.join(__dirname, '..', '..');
}

export async function infoCommand(argv: string[]): Promise<void> {
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
    `  engines:  ${engines.join(', ')}${engines.includes('nixl') ? '' : ' (NIXL not compiled in: set NIXL_PREFIX and reinstall)'}`,
  );
  if (out.nixlPlugins) console.log(`  NIXL plugins: ${(out.nixlPlugins as string[]).join(', ')}`);
  console.log(`  addon:    ${out.addon}`);
}
