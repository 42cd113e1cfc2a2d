// The house: the command (cli/) on top, then demo/ and bench/, then lib/;
// nothing imports a folder on a floor above its own (demo and bench once
// imported cli/args.ts while the CLI ran them).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
const ROOT = path.join(__dirname, '..');

const FLOOR: Record<string, number> = { cli: 3, demo: 2, bench: 2, lib: 1 };

function sources(dir: string): string[] {
  return fs
    .readdirSync(path.join(ROOT, dir), { recursive: true, encoding: 'utf8' })
    .filter((f) => f.endsWith('.ts'))
    .map((f) => path.join(dir, f));
}

it('no import runs to a floor above: cli -> demo, bench -> lib', () => {
  const wrong: string[] = [];
  let seen = 0;
  for (const file of Object.keys(FLOOR).flatMap(sources)) {
    const from = file.split(path.sep)[0];
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    for (const m of text.matchAll(/(?:from\s+|import\()\s*'(\.[^']+)'/g)) {
      seen++;
      const target = path.relative(ROOT, path.resolve(ROOT, path.dirname(file), m[1])).split(path.sep)[0];
      if (!(target in FLOOR)) wrong.push(`${file} imports ${m[1]} (outside the floors)`);
      else if (FLOOR[target] > FLOOR[from]) wrong.push(`${file} (${from}) imports ${m[1]} (${target}, a floor above)`);
    }
  }
  expect(seen).toBeGreaterThan(100);
  expect(wrong).toEqual([]);
});

/** lib/'s import graph: file -> the lib files it imports (type-only imports too). */
function libGraph(): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  for (const file of sources('lib')) {
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    const deps: string[] = [];
    for (const m of text.matchAll(/(?:from\s+|import\()\s*'(\.[^']+)'/g)) {
      const base = path.relative(ROOT, path.resolve(ROOT, path.dirname(file), m[1]));
      const hit = [`${base}.ts`, path.join(base, 'index.ts')].find((f) => fs.existsSync(path.join(ROOT, f)));
      if (hit) deps.push(hit);
    }
    graph.set(file, deps);
  }
  return graph;
}

/** Every import cycle, each once, as its files in order. */
function cycles(graph: Map<string, string[]>): string[][] {
  const found = new Map<string, string[]>();
  const state = new Map<string, 'open' | 'done'>();
  const stack: string[] = [];
  const visit = (f: string) => {
    state.set(f, 'open');
    stack.push(f);
    for (const d of graph.get(f) ?? []) {
      if (state.get(d) === 'open') {
        const c = stack.slice(stack.indexOf(d));
        found.set([...c].sort().join(' '), c);
      } else if (!state.has(d)) visit(d);
    }
    stack.pop();
    state.set(f, 'done');
  };
  for (const f of graph.keys()) if (!state.has(f)) visit(f);
  return [...found.values()];
}

it('lib/ has no import cycle (a front depends on an interface, not on the worker that starts it)', () => {
  const graph = libGraph();
  expect(graph.size).toBeGreaterThan(30);
  expect(cycles(graph).map((c) => [...c, c[0]].join(' -> '))).toEqual([]);
  // The finder itself: a cycle planted in the graph is found.
  const planted = new Map(graph);
  planted.set('lib/serving/worker-http.ts', [...graph.get('lib/serving/worker-http.ts')!, 'lib/serving/worker.ts']);
  expect(cycles(planted).length).toBeGreaterThan(0);
});
