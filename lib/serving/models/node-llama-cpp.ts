// Loads node-llama-cpp, the optional peer dependency behind GGUF workers.
// Kept out of the package's public declarations: they would name its types,
// and an application without it installed would no longer type-check.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { pathToFileURL } from 'node:url';
import type * as Nlc from 'node-llama-cpp';
import { NixlError } from '../../errors';
import { NODE_LLAMA_CPP } from './types';

// tsc (module commonjs) turns import() into require(), which cannot load
// node-llama-cpp (ESM with top-level await): the compiled package imports
// through a Function. Code run in a vm without a dynamic-import hook (vitest
// runs this source so) cannot; there the plain import() is the runner's own.
const viaFunction = new Function('url', 'return import(url)') as (url: string) => Promise<unknown>;

async function importEsm(url: string): Promise<unknown> {
  try {
    return await viaFunction(url);
  } catch (e) {
    if ((e as { code?: string }).code !== 'ERR_VM_DYNAMIC_IMPORT_CALLBACK_MISSING') throw e;
    return import(url);
  }
}

/** node-llama-cpp, or a NixlError (NIXL_ERR_NOT_SUPPORTED) naming the package to install. */
export async function loadNodeLlamaCpp(): Promise<typeof Nlc> {
  let resolved: string;
  try {
    resolved = require.resolve('node-llama-cpp');
  } catch {
    throw new NixlError(
      `a GGUF model needs node-llama-cpp, which is not installed: npm i -E ${NODE_LLAMA_CPP}`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  }
  checkNodeLlamaCppVersion(installedVersion(resolved));
  return (await importEsm(pathToFileURL(resolved).href)) as typeof Nlc;
}

/** The version in the package.json above node-llama-cpp's entry point. */
function installedVersion(entry: string): string | undefined {
  for (let dir = path.dirname(entry); dir !== path.dirname(dir); dir = path.dirname(dir)) {
    try {
      const pkg = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8')) as {
        name?: string;
        version?: string;
      };
      if (pkg.name === 'node-llama-cpp') return pkg.version;
    } catch {
      /* no package.json here: one level up */
    }
  }
  return undefined;
}

/**
 * GGUF workers move node-llama-cpp's saved states between processes and
 * depend on its generation details: another release is refused at start
 * (NIXL_ERR_NOT_SUPPORTED), naming the one to install.
 */
export function checkNodeLlamaCppVersion(version: string | undefined): void {
  const want = NODE_LLAMA_CPP.slice(NODE_LLAMA_CPP.lastIndexOf('@') + 1);
  if (version !== want)
    throw new NixlError(
      `node-llama-cpp ${version ?? '(unknown version)'} is installed, but GGUF workers need exactly ${want}: npm i -E ${NODE_LLAMA_CPP}`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
}
