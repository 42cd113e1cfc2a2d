// The model boundary (lib/serving/models/) owns tokens and KV bytes and
// nothing else: it imports only itself, lib/errors.ts and the API's types
// (lib/serving/api/), never the KV transfers, the handshake, the agent, the
// worker or the proxy, so a model can be read, tested and replaced alone.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
const ROOT = path.join(__dirname, '..', '..');
const MODELS = 'lib/serving/models';

/** Every relative import under lib/serving/models/: [file, specifier, target (without extension), type-only]. */
function imports(): Array<{ file: string; spec: string; target: string; typeOnly: boolean }> {
  const out: Array<{ file: string; spec: string; target: string; typeOnly: boolean }> = [];
  const files = fs
    .readdirSync(path.join(ROOT, MODELS), { recursive: true, encoding: 'utf8' })
    .filter((f) => f.endsWith('.ts'))
    .map((f) => path.join(MODELS, f));
  for (const file of files) {
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    for (const m of text.matchAll(/(import\s+type\b[^;]*?from\s+|from\s+|import\()\s*'(\.[^']+)'/g))
      out.push({
        file,
        spec: m[2],
        target: path
          .relative(ROOT, path.resolve(ROOT, path.dirname(file), m[2]))
          .split(path.sep)
          .join('/'),
        typeOnly: m[1].startsWith('import type'),
      });
  }
  return out;
}

/** Why an import breaks the boundary, or undefined. */
function breaks(i: { target: string; typeOnly: boolean }): string | undefined {
  if (i.target === MODELS || i.target.startsWith(`${MODELS}/`) || i.target === 'lib/errors') return undefined;
  if (i.target.startsWith('lib/serving/api/')) return i.typeOnly ? undefined : 'the API: types only';
  return 'outside the boundary';
}

it('lib/serving/models/ imports only itself, lib/errors.ts and the API types', () => {
  const all = imports();
  expect(all.length).toBeGreaterThan(30);
  const wrong = all.flatMap((i) => {
    const why = breaks(i);
    return why ? [`${i.file} imports ${i.spec} (${why})`] : [];
  });
  expect(wrong).toEqual([]);
  // The rule itself: an import of the worker, kv, or a value of the API is caught.
  expect(breaks({ target: 'lib/serving/worker/worker', typeOnly: true })).toBeDefined();
  expect(breaks({ target: 'lib/kv/pull/puller', typeOnly: false })).toBeDefined();
  expect(breaks({ target: 'lib/agent', typeOnly: true })).toBeDefined();
  expect(breaks({ target: 'lib/serving/api/http', typeOnly: false })).toBeDefined();
  expect(breaks({ target: 'lib/serving/api/openai', typeOnly: true })).toBeUndefined();
});
