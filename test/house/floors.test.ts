// The house: the command (cli/) on top, then demo/ and bench/, then lib/;
// nothing imports a folder on a floor above its own (demo and bench once
// imported cli/args.ts while the CLI ran them), demo/ and bench/ do not
// import each other, the command takes only their entry points (once it
// reached into demo/ for the test-model writer), and lib/ holds no
// command-line code (option parsing that exits the process once lived there).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
const ROOT = path.join(__dirname, '..', '..');

const FLOOR: Record<string, number> = { cli: 3, demo: 2, bench: 2, lib: 1 };

function sources(dir: string): string[] {
  return fs
    .readdirSync(path.join(ROOT, dir), { recursive: true, encoding: 'utf8' })
    .filter((f) => f.endsWith('.ts'))
    .map((f) => path.join(dir, f));
}

/** Every relative import of the floors: [importing file, its folder, the specifier, the target path]. */
function imports(): Array<{ file: string; from: string; spec: string; target: string }> {
  const out: Array<{ file: string; from: string; spec: string; target: string }> = [];
  for (const file of Object.keys(FLOOR).flatMap(sources)) {
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    for (const m of text.matchAll(/(?:from\s+|import\()\s*'(\.[^']+)'/g))
      out.push({
        file,
        from: file.split(path.sep)[0],
        spec: m[1],
        target: path.relative(ROOT, path.resolve(ROOT, path.dirname(file), m[1])),
      });
  }
  return out;
}

it('no import runs to a floor above: cli -> demo, bench -> lib', () => {
  const wrong: string[] = [];
  const all = imports();
  for (const { file, from, spec, target } of all) {
    const floor = target.split(path.sep)[0];
    if (!(floor in FLOOR)) wrong.push(`${file} imports ${spec} (outside the floors)`);
    else if (FLOOR[floor] > FLOOR[from]) wrong.push(`${file} (${from}) imports ${spec} (${floor}, a floor above)`);
  }
  expect(all.length).toBeGreaterThan(100);
  expect(wrong).toEqual([]);
});

/** What the command may take from the apps: their entry points, nothing of the library kind. */
const APP_ENTRIES = new Set(['demo/run', 'demo/serving', 'bench/run', 'bench/native']);

it('demo/ and bench/ do not import each other; the command takes only their entry points', () => {
  const wrong: string[] = [];
  for (const { file, from, spec, target } of imports()) {
    const floor = target.split(path.sep)[0];
    if ((from === 'demo' && floor === 'bench') || (from === 'bench' && floor === 'demo'))
      wrong.push(`${file} imports ${spec} (apps on one floor: what both need belongs in lib/)`);
    if (from === 'cli' && (floor === 'demo' || floor === 'bench') && !APP_ENTRIES.has(target.split(path.sep).join('/')))
      wrong.push(`${file} imports ${spec} (not an app entry point: library code belongs in lib/)`);
  }
  expect(wrong).toEqual([]);
});

it('lib/ holds no command-line code: no process.exit, no option parsing', () => {
  const wrong: string[] = [];
  for (const file of sources('lib')) {
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    if (/process\.exit\s*\(/.test(text)) wrong.push(`${file} calls process.exit`);
    if (/\bparseArgs\b|process\.argv/.test(text)) wrong.push(`${file} parses the command line`);
  }
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
  planted.set('lib/serving/worker/fronts/http.ts', [
    ...graph.get('lib/serving/worker/fronts/http.ts')!,
    'lib/serving/worker/worker.ts',
  ]);
  expect(cycles(planted).length).toBeGreaterThan(0);
});
