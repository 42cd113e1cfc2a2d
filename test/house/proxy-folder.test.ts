// The proxy's folder (lib/serving/proxy/): it routes requests and never
// touches KV itself, so it imports neither the agent, lib/kv/, the models
// nor the worker's folder; and the KV mode is a strategy picked once, so
// only handoff-push.ts speaks of push (a 'push' comparison or transfer_mode).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';

const ROOT = path.join(__dirname, '..', '..');
const PROXY = path.join('lib', 'serving', 'proxy');

function files(): string[] {
  return fs
    .readdirSync(path.join(ROOT, PROXY), { recursive: true, encoding: 'utf8' })
    .filter((f) => f.endsWith('.ts'))
    .map((f) => path.join(PROXY, f));
}

const FORBIDDEN = [
  path.join('lib', 'agent'),
  path.join('lib', 'kv') + path.sep,
  path.join('lib', 'serving', 'models') + path.sep,
  path.join('lib', 'serving', 'worker') + path.sep,
];

it("the proxy's folder imports neither the agent, lib/kv, the models nor the worker's folder", () => {
  const wrong: string[] = [];
  for (const file of files()) {
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    for (const m of text.matchAll(/(?:from\s+|import\()\s*'(\.[^']+)'/g)) {
      const target = path.relative(ROOT, path.resolve(ROOT, path.dirname(file), m[1]));
      if (FORBIDDEN.some((f) => `${target}${path.sep}`.startsWith(f))) wrong.push(`${file} imports ${m[1]}`);
    }
  }
  expect(wrong).toEqual([]);
});

it('only handoff-push.ts compares a KV mode with push or names transfer_mode', () => {
  const wrong: string[] = [];
  for (const file of files()) {
    if (path.basename(file) === 'handoff-push.ts') continue;
    const code = fs
      .readFileSync(path.join(ROOT, file), 'utf8')
      .replace(/\/\*[\s\S]*?\*\//g, '')
      .replace(/\/\/.*$/gm, '');
    if (/[!=]==?\s*'push'|'push'\s*[!=]==?|transfer_mode/.test(code)) wrong.push(file);
  }
  expect(wrong).toEqual([]);
});
