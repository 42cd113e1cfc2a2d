// The API reference: TypeDoc over the public exports (lib/index.ts) with its
// validation on (typedoc.json: every exported symbol documented, no broken
// link, nothing referenced that is not exported) and warnings as errors, as
// `npm run docs` builds it.
import { spawnSync } from 'node:child_process';
import * as path from 'node:path';
import { expect, it } from 'vitest';

const ROOT = path.join(__dirname, '..');

it('npm run docs: TypeDoc validates the public API with no warning', () => {
  const r = spawnSync(process.execPath, [path.join(ROOT, 'node_modules/typedoc/bin/typedoc'), '--emit', 'none'], {
    cwd: ROOT,
    encoding: 'utf8',
  });
  expect(`${r.stdout}${r.stderr}`).not.toMatch(/warning|error/i);
  expect(r.status).toBe(0);
}, 120_000);
