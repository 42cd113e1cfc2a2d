// The house: the command (cli/) on top, then demo/ and bench/, then lib/;
// nothing imports a folder on a floor above its own, demo/ and bench/ do not
// import each other, the command takes only their entry points, and lib/
// holds no command-line code. Inside lib/: no import cycle, each serving
// folder imports only what its role needs, no file over 550 lines, and the
// KV mode is compared with 'push' only in the push handoff's files.
import * as fs from 'node:fs';
import * as path from 'node:path';
import * as ts from 'typescript';
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

/** One import inside lib/: the lib file it reaches, and whether only types cross it (erased at run time). */
interface Edge {
  to: string;
  typeOnly: boolean;
}

/** The lib file a relative specifier names, if any. */
function resolveLib(file: string, spec: string): string | undefined {
  const base = path.relative(ROOT, path.resolve(ROOT, path.dirname(file), spec));
  return [`${base}.ts`, path.join(base, 'index.ts')].find((f) => fs.existsSync(path.join(ROOT, f)));
}

/** lib/'s imports, read by TypeScript's parser: static imports and re-exports, import() and require(). */
function libEdges(): Map<string, Edge[]> {
  const edges = new Map<string, Edge[]>();
  for (const file of sources('lib')) {
    const src = ts.createSourceFile(file, fs.readFileSync(path.join(ROOT, file), 'utf8'), ts.ScriptTarget.Latest);
    const out: Edge[] = [];
    const add = (spec: string, typeOnly: boolean) => {
      const to = spec.startsWith('.') ? resolveLib(file, spec) : undefined;
      if (to) out.push({ to, typeOnly });
    };
    const visit = (n: ts.Node): void => {
      if (ts.isImportDeclaration(n) && ts.isStringLiteral(n.moduleSpecifier)) {
        const c = n.importClause;
        const named = c?.namedBindings && ts.isNamedImports(c.namedBindings) ? c.namedBindings.elements : undefined;
        const allTypes = !!c && !c.name && !!named?.length && named.every((e) => e.isTypeOnly);
        add(n.moduleSpecifier.text, !!c?.isTypeOnly || allTypes);
      } else if (ts.isExportDeclaration(n) && n.moduleSpecifier && ts.isStringLiteral(n.moduleSpecifier)) {
        const named = n.exportClause && ts.isNamedExports(n.exportClause) ? n.exportClause.elements : undefined;
        add(n.moduleSpecifier.text, n.isTypeOnly || (!!named?.length && named.every((e) => e.isTypeOnly)));
      } else if (
        ts.isCallExpression(n) &&
        (n.expression.kind === ts.SyntaxKind.ImportKeyword ||
          (ts.isIdentifier(n.expression) && n.expression.text === 'require')) &&
        n.arguments.length === 1 &&
        ts.isStringLiteral(n.arguments[0])
      ) {
        add(n.arguments[0].text, false);
      } else if (ts.isImportTypeNode(n) && ts.isLiteralTypeNode(n.argument) && ts.isStringLiteral(n.argument.literal)) {
        add(n.argument.literal.text, true);
      }
      ts.forEachChild(n, visit);
    };
    visit(src);
    edges.set(file, out);
  }
  return edges;
}

/** lib/'s import graph: file -> the lib files it imports (type-only imports too). */
function libGraph(): Map<string, string[]> {
  return new Map([...libEdges()].map(([f, es]) => [f, es.map((e) => e.to)]));
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

// Folder rules inside lib/serving: what each folder may import besides its own
// files (an allow-list, as FLOOR is for the apps). A rule names the folder's
// files by prefix, so the worker's rule holds for worker/fronts/ as well.
interface FolderRule {
  folder: string;
  /** Lib files or folders it may import. */
  may: string[];
  /** Lib folders it may import types from only (nothing of them runs). */
  typesFrom?: string[];
  /** Files inside what `may` allows that it still must not import. */
  never?: string[];
}

const WORKER_MAY = [
  'lib/serving/api/',
  'lib/serving/models/',
  'lib/serving/fleet/',
  'lib/serving/log.ts',
  'lib/kv/',
  'lib/handshake/',
  'lib/agent/',
  'lib/descriptors.ts',
  'lib/errors.ts',
  'lib/tracing.ts',
];

const FOLDER_RULES: FolderRule[] = [
  // The wire shapes both processes speak: nothing of who speaks them.
  { folder: 'lib/serving/api/', may: ['lib/errors.ts'], typesFrom: ['lib/handshake/'] },
  // Tokens and KV bytes: no transfer, side channel, agent, worker or proxy.
  { folder: 'lib/serving/models/', may: ['lib/errors.ts', 'lib/serving/api/'] },
  // The proxy routes requests and holds no KV: no agent, kv, model or worker code.
  {
    folder: 'lib/serving/proxy/',
    may: [
      'lib/serving/api/',
      'lib/serving/fleet/',
      'lib/serving/kv-index/',
      'lib/serving/log.ts',
      'lib/handshake/',
      'lib/errors.ts',
      'lib/tracing.ts',
    ],
  },
  // A worker answers a proxy and never imports one.
  { folder: 'lib/serving/worker/', may: WORKER_MAY },
  // A front depends on the FrontHandler interface (fronts/front.ts), not on the worker that starts it.
  {
    folder: 'lib/serving/worker/fronts/',
    may: [...WORKER_MAY, 'lib/serving/worker/'],
    never: ['lib/serving/worker/worker.ts'],
  },
];

/**
 * Today's breaches of FOLDER_RULES, as `from -> to`, each fixed on a branch of
 * its own: the list shrinks and never grows, and an entry that no longer
 * breaks its rule fails the test until it is removed.
 */
const KNOWN_EDGES: string[] = [];

const under = (file: string, prefix: string) => (prefix.endsWith('/') ? file.startsWith(prefix) : file === prefix);

/** Every import that breaks a folder rule, as `from -> to`. */
function folderBreaches(edges: Map<string, Edge[]>, rules: FolderRule[]): string[] {
  const out = new Set<string>();
  for (const [file, es] of edges)
    for (const rule of rules.filter((r) => file.startsWith(r.folder)))
      for (const { to, typeOnly } of es) {
        const allowed =
          under(to, rule.folder) ||
          rule.may.some((p) => under(to, p)) ||
          (typeOnly && (rule.typesFrom ?? []).some((p) => under(to, p)));
        if (!allowed || (rule.never ?? []).some((p) => under(to, p))) out.add(`${file} -> ${to}`);
      }
  return [...out];
}

it('lib/serving folders import only what their role needs (allow-lists; KNOWN_EDGES shrinks)', () => {
  const edges = libEdges();
  const found = folderBreaches(edges, FOLDER_RULES);
  expect(found.filter((e) => !KNOWN_EDGES.includes(e))).toEqual([]);
  expect(
    KNOWN_EDGES.filter((e) => !found.includes(e)),
    'fixed: remove from KNOWN_EDGES',
  ).toEqual([]);
  // Each rule, broken on purpose: an edge planted in the graph is found.
  const planted: Array<[string, string, boolean?]> = [
    ['lib/serving/api/openai.ts', 'lib/serving/worker/worker.ts'],
    ['lib/serving/api/openai.ts', 'lib/serving/proxy/pool.ts'],
    ['lib/serving/api/openai.ts', 'lib/handshake/wire.ts'], // a runtime import of handshake
    ['lib/serving/models/types.ts', 'lib/kv/layout.ts'],
    ['lib/serving/models/types.ts', 'lib/handshake/model.ts', true],
    ['lib/serving/models/types.ts', 'lib/agent/agent.ts'],
    ['lib/serving/models/types.ts', 'lib/serving/worker/turns.ts'],
    ['lib/serving/models/types.ts', 'lib/serving/proxy/pool.ts'],
    ['lib/serving/proxy/pool.ts', 'lib/agent/agent.ts'],
    ['lib/serving/proxy/pool.ts', 'lib/kv/layout.ts', true],
    ['lib/serving/proxy/pool.ts', 'lib/serving/models/types.ts', true],
    ['lib/serving/proxy/pool.ts', 'lib/serving/worker/turns.ts'],
    ['lib/serving/worker/turns.ts', 'lib/serving/proxy/pool.ts', true],
    ['lib/serving/worker/fronts/zmq.ts', 'lib/serving/proxy/transports/zmq.ts'],
    ['lib/serving/worker/fronts/http.ts', 'lib/serving/worker/worker.ts', true],
  ];
  for (const [from, to, typeOnly] of planted) {
    expect(edges.has(from) && fs.existsSync(path.join(ROOT, to)), `${from}, ${to}`).toBe(true);
    const g = new Map(edges);
    g.set(from, [...edges.get(from)!, { to, typeOnly: typeOnly === true }]);
    expect(folderBreaches(g, FOLDER_RULES), `planted ${from} -> ${to}`).toContain(`${from} -> ${to}`);
  }
  // What a rule allows stays allowed: api/ may take handshake's types.
  const g = new Map(edges);
  g.set('lib/serving/api/openai.ts', [
    ...edges.get('lib/serving/api/openai.ts')!,
    { to: 'lib/handshake/model.ts', typeOnly: true },
  ]);
  expect(folderBreaches(g, FOLDER_RULES)).toEqual(found);
});

/** A lib file's lines (as wc -l counts them). */
const lineCount = (text: string) => text.split('\n').length - (text.endsWith('\n') ? 1 : 0);

const MAX_LINES = 550;

/**
 * Today's files over MAX_LINES, with their lines today: each may shrink, never
 * grow, and leaves this list once it is under the bar.
 */
const KNOWN_LONG: Record<string, number> = {};

/** Every file over the bar beyond what KNOWN_LONG allows, and every KNOWN_LONG entry now under it. */
function lengthBreaches(lines: Map<string, number>, known: Record<string, number>): string[] {
  const out: string[] = [];
  for (const [file, n] of lines) {
    if (n <= MAX_LINES) continue;
    if (known[file] === undefined) out.push(`${file}: ${n} lines (at most ${MAX_LINES})`);
    else if (n > known[file]) out.push(`${file}: ${n} lines, grown from ${known[file]}`);
  }
  for (const file of Object.keys(known))
    if ((lines.get(file) ?? 0) <= MAX_LINES) out.push(`${file}: under ${MAX_LINES} lines now, remove from KNOWN_LONG`);
  return out;
}

it(`no file in lib/ over ${MAX_LINES} lines (KNOWN_LONG shrinks)`, () => {
  const lines = new Map(sources('lib').map((f) => [f, lineCount(fs.readFileSync(path.join(ROOT, f), 'utf8'))]));
  expect(lengthBreaches(lines, KNOWN_LONG)).toEqual([]);
  // Broken on purpose: a new long file, a known one grown, and the agent grown past the bar.
  const known = { ...KNOWN_LONG, 'lib/serving/worker/worker.ts': MAX_LINES + 10 };
  const planted = new Map(lines);
  planted.set('lib/serving/planted.ts', MAX_LINES + 1);
  planted.set('lib/serving/worker/worker.ts', MAX_LINES + 11);
  planted.set('lib/agent/agent.ts', MAX_LINES + 1);
  expect(lengthBreaches(planted, known).sort()).toEqual([
    `lib/agent/agent.ts: ${MAX_LINES + 1} lines (at most ${MAX_LINES})`,
    `lib/serving/planted.ts: ${MAX_LINES + 1} lines (at most ${MAX_LINES})`,
    `lib/serving/worker/worker.ts: ${MAX_LINES + 11} lines, grown from ${MAX_LINES + 10}`,
  ]);
  expect(lengthBreaches(lines, { ...KNOWN_LONG, 'lib/errors.ts': 600 })).toEqual([
    `lib/errors.ts: under ${MAX_LINES} lines now, remove from KNOWN_LONG`,
  ]);
});

// The KV mode is picked once, when a worker or proxy starts: only the push
// handoff's files compare it with 'push'.
const PUSH_MODE = /[!=]==\s*'push'|'push'\s*[!=]==|\btransfer_mode\b|#isPush\b/g;
const PUSH_HOME = /(^|\/)handoff-push\.ts$/;

/**
 * Today's files in lib/serving that compare a KV mode with 'push', with how
 * many times: a count only goes down (change it here when it does), and a file
 * leaves this list at zero.
 */
const KNOWN_PUSH: Record<string, number> = {};

function pushBreaches(texts: Map<string, string>, known: Record<string, number>): string[] {
  const out: string[] = [];
  const counts = new Map<string, number>();
  for (const [file, text] of texts) if (!PUSH_HOME.test(file)) counts.set(file, [...text.matchAll(PUSH_MODE)].length);
  for (const [file, n] of counts)
    if (n !== (known[file] ?? 0))
      out.push(`${file}: ${n} comparisons with 'push' (KNOWN_PUSH: ${known[file] ?? 0}; only handoff-push.ts may)`);
  for (const file of Object.keys(known)) if (!counts.has(file)) out.push(`${file}: gone, remove from KNOWN_PUSH`);
  return out;
}

it("only handoff-push.ts files in lib/serving compare a KV mode with 'push' (KNOWN_PUSH shrinks)", () => {
  const texts = new Map(
    sources('lib/serving').map((f) => [f.split(path.sep).join('/'), fs.readFileSync(path.join(ROOT, f), 'utf8')]),
  );
  expect(pushBreaches(texts, KNOWN_PUSH)).toEqual([]);
  // Broken on purpose: a new file that branches on the mode; the handoff's own file may.
  const planted = new Map(texts);
  planted.set('lib/serving/proxy/planted.ts', "if (o.kvMode === 'push') go();\nif (kvp.transfer_mode) go();");
  planted.set('lib/serving/worker/handoff-push.ts', "if (o.kvMode === 'push') go();");
  expect(pushBreaches(planted, KNOWN_PUSH)).toEqual([
    "lib/serving/proxy/planted.ts: 2 comparisons with 'push' (KNOWN_PUSH: 0; only handoff-push.ts may)",
  ]);
});
