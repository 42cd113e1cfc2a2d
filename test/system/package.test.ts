// As a user gets it: pack the tarball, install it into a fresh app with an
// empty user npmrc, check that nothing was compiled (the prebuild loads), and
// import it by name from CommonJS, ESM and strict TypeScript (nodenext),
// each running a READ with every byte verified.
import { type ChildProcess, execFileSync, spawn, spawnSync } from 'node:child_process';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { ROOT, strictTsApp } from '../helpers';

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-node-pack-'));
const app = path.join(tmp, 'app');
let installLog = '';
afterAll(() => fs.rmSync(tmp, { recursive: true, force: true }));

const npm = (args: string[], cwd: string) =>
  execFileSync('npm', args, {
    cwd,
    encoding: 'utf8',
    stdio: 'pipe',
    // An empty user npmrc, none of this repo's settings (nodedir=/usr), and a
    // user without NIXL (with NIXL_PREFIX set, the install builds from source by design).
    env: {
      ...Object.fromEntries(Object.entries(process.env).filter(([k]) => k !== 'NIXL_PREFIX')),
      npm_config_userconfig: path.join(tmp, 'empty-npmrc'),
      npm_config_nodedir: '',
    },
  });

// The same job in every form: READ 1 MiB between two agents, check each byte.
const body = `
const a = new NixlAgent('pkg-a', { engine: 'loopback' });
const b = new NixlAgent('pkg-b', { engine: 'loopback' });
const src = allocate(1 << 20);
for (let i = 0; i < src.length; i++) src[i] = (i * 7 + 3) & 0xff;
const dst = Buffer.alloc(1 << 20);
a.registerMemory(dst);
b.registerMemory(src);
a.addRemoteAgent(b.getAgentMetadata());
await a.read(dst, [{ addr: DescList.from(src).addr(0), len: src.length }], 'pkg-b');
if (!dst.equals(src)) throw new Error('bytes differ');
a.close();
b.close();
console.log('READ ok');
`;

// npm pack runs prepack (tsc, prebuildify), and prebuildify rebuilds build/:
// pack a copy, so the tests running beside this one keep their addon.
function copyTree(): string {
  const dir = path.join(tmp, 'src');
  for (const f of [
    'native',
    'scripts',
    'lib',
    'demo',
    'bench',
    'cli',
    'bin',
    'binding.gyp',
    'CMakeLists.txt',
    'package.json',
    '.npmrc',
    'tsconfig.json',
    'LICENSE',
    'README.md',
    'docs',
  ]) {
    fs.cpSync(path.join(ROOT, f), path.join(dir, f), { recursive: true });
  }
  fs.symlinkSync(path.join(ROOT, 'node_modules'), path.join(dir, 'node_modules'));
  return dir;
}

beforeAll(() => {
  fs.writeFileSync(path.join(tmp, 'empty-npmrc'), '');
  const src = copyTree();
  const tarball = execFileSync('npm', ['pack', '--pack-destination', tmp, '--silent'], { cwd: src, encoding: 'utf8' })
    .trim()
    .split('\n')
    .pop()!;
  fs.mkdirSync(app);
  fs.writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'app', version: '1.0.0', private: true }));
  installLog = npm(
    ['install', '--no-audit', '--no-fund', '--prefer-offline', '--foreground-scripts', path.join(tmp, tarball)],
    app,
  );
}, 300_000);

it('the tarball ships the built JavaScript, types and a prebuild, and no tests or source maps', () => {
  const pkg = path.join(app, 'node_modules', 'nixl-node');
  expect(fs.existsSync(path.join(pkg, 'dist', 'lib', 'index.js'))).toBe(true);
  expect(fs.existsSync(path.join(pkg, 'dist', 'lib', 'index.d.ts'))).toBe(true);
  expect(fs.existsSync(path.join(pkg, 'LICENSE'))).toBe(true);
  expect(fs.readdirSync(path.join(pkg, 'prebuilds'))).toContain(`${process.platform}-${process.arch}`);
  const all = fs.readdirSync(pkg, { recursive: true }).map(String);
  expect(all.filter((f) => f.endsWith('.map') || f.startsWith('test'))).toEqual([]);
});

it('installing compiles nothing: the prebuild loads', () => {
  expect(installLog).toContain('using the prebuilt addon');
  // What the README's "Running on a GPU / RDMA host" says to look for, as npm run build prints it.
  expect(installLog).toMatch(/^nixl-node: engines compiled in: loopback$/m);
  expect(fs.existsSync(path.join(app, 'node_modules', 'nixl-node', 'build'))).toBe(false);
});

it('the nixl-node command runs from the app (bin): info names the prebuild, the demo verifies every byte', () => {
  const bin = path.join(app, 'node_modules', '.bin', 'nixl-node');
  const info = JSON.parse(execFileSync(bin, ['info', '--json'], { cwd: app, encoding: 'utf8' }));
  expect(info.addon).toMatch(/^prebuilds\/linux-x64\//);
  const demo = execFileSync(bin, ['demo', '--engine=loopback', '--layers=2', '--blocks=16', '--requests=4'], {
    cwd: app,
    encoding: 'utf8',
  });
  expect(demo).toMatch(/verified\s+every byte/);
  // The serving demo runs the installed proxy and workers as processes.
  const serving = execFileSync(bin, ['demo', '--serving', '--requests=8', '--json'], { cwd: app, encoding: 'utf8' });
  expect(JSON.parse(serving.trim().split('\n').at(-1)!)).toMatchObject({ requests: 8, completed: 8, failed: 0 });
  expect(fs.existsSync(path.join(app, 'node_modules', 'nixl-node', 'docs', 'side-channel-http.schema.json'))).toBe(
    true,
  );
}, 60_000);

it('traces and /metrics from a plain install: the optional dependencies came with it', async () => {
  const bin = path.join(app, 'node_modules', '.bin', 'nixl-node');
  for (const name of [
    'prom-client',
    '@opentelemetry/sdk-trace-base',
    '@opentelemetry/exporter-trace-otlp-http',
    'pino',
  ])
    expect(fs.existsSync(path.join(app, 'node_modules', name, 'package.json')), name).toBe(true);
  // An OTLP collector that takes anything: --otlp-endpoint starts, no package to install by hand.
  const collector = http.createServer((req, res) => req.resume().on('end', () => res.end('{}')));
  await new Promise<void>((r) => collector.listen(0, '127.0.0.1', () => r()));
  const otlp = `http://127.0.0.1:${(collector.address() as AddressInfo).port}`;
  const procs: ChildProcess[] = [];
  const ready = (args: string[]) =>
    new Promise<Record<string, unknown>>((resolve, reject) => {
      const p = spawn(bin, args, { cwd: app, stdio: ['ignore', 'pipe', 'pipe'] });
      procs.push(p);
      let err = '';
      p.stderr!.on('data', (d) => (err += d));
      p.stdout!.on('data', (d) => {
        const line = String(d)
          .split('\n')
          .find((l) => l.includes('"ready":true'));
        if (line) resolve(JSON.parse(line));
      });
      p.once('exit', (c) => reject(new Error(`${args[0]} exited ${c}: ${err}`)));
    });
  try {
    const w = await ready(['worker', '--otlp-endpoint', otlp]);
    const proxy = await ready(['proxy', '--port', '0', '--pd-addrs', String(w.address), '--otlp-endpoint', otlp]);
    const r = await fetch(`${proxy.url}/v1/completions`, { method: 'POST', body: '{"prompt":"x","max_tokens":2}' });
    expect(r.status).toBe(200);
    const m = await fetch(`${proxy.url}/metrics`);
    expect(m.status).toBe(200);
    expect(await m.text()).toMatch(/nixl_node_proxy_requests_total\{route="\/v1\/completions",status="200"\} 1/);
  } finally {
    for (const p of procs) p.kill('SIGTERM');
    await new Promise((r) => collector.close(r));
  }
}, 60_000);

it('a GGUF without node-llama-cpp installed: one line naming the package to install, exit code 2', () => {
  const bin = path.join(app, 'node_modules', '.bin', 'nixl-node');
  for (const args of [
    ['worker', '--model', 'tiny'],
    ['demo', '--serving', '--model', 'tiny'],
  ]) {
    const r = spawnSync(bin, args, { cwd: app, encoding: 'utf8', timeout: 30_000 });
    expect(r.status, r.stderr).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(/npm i -E node-llama-cpp@3\.21\.1$/)]);
  }
}, 60_000);

it('strict TypeScript: the wire profiles and the serving API type-check from the package', () => {
  strictTsApp(app, { files: ['serve.mts'] });
  fs.writeFileSync(
    path.join(app, 'serve.mts'),
    [
      "import { buildKvTransferParams, parseKvTransferParams, startProxy, startWorker, type KvTransferParams, type WireName } from 'nixl-node';",
      "const wire: WireName = 'v12';",
      "const w = await startWorker({ name: 'ts-worker', wire });",
      'const p = await startProxy({ prefill: [w.address], decode: [w.address], healthIntervalMs: 0 });',
      "const r = await fetch(p.url + '/v1/completions', { method: 'POST', body: JSON.stringify({ prompt: 'hi', max_tokens: 2 }) });",
      'const params: KvTransferParams = parseKvTransferParams(buildKvTransferParams({ remoteBlockIds: [[1]], remoteEngineId: "e", remoteRequestId: "r", remoteHost: "h", remotePort: 1, tpSize: 1 }, wire), wire);',
      'console.log(r.status, params.transferMode);',
      'await p.close();',
      'await w.close();',
    ].join('\n'),
  );
  execFileSync(process.execPath, [path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', '.'], {
    cwd: app,
    encoding: 'utf8',
  });
  expect(execFileSync(process.execPath, ['out/serve.mjs'], { cwd: app, encoding: 'utf8' })).toContain('200 pull');
}, 60_000);

it('require by name (CommonJS)', () => {
  fs.writeFileSync(
    path.join(app, 'cjs.cjs'),
    `const { NixlAgent, DescList, allocate } = require('nixl-node');\n(async () => {${body}})().catch((e) => { console.error(e); process.exit(1); });`,
  );
  expect(execFileSync(process.execPath, ['cjs.cjs'], { cwd: app, encoding: 'utf8' })).toContain('READ ok');
});

it('import by name (ESM, named exports)', () => {
  fs.writeFileSync(path.join(app, 'esm.mjs'), `import { NixlAgent, DescList, allocate } from 'nixl-node';\n${body}`);
  expect(execFileSync(process.execPath, ['esm.mjs'], { cwd: app, encoding: 'utf8' })).toContain('READ ok');
});

it('strict TypeScript with nodenext resolution compiles and runs', () => {
  strictTsApp(app, { files: ['main.mts'] });
  fs.writeFileSync(
    path.join(app, 'main.mts'),
    `import { NixlAgent, DescList, allocate, NixlError, type XferState } from 'nixl-node';\nconst s: XferState = 'DONE';\nvoid s;\nvoid NixlError;\n${body}`,
  );
  execFileSync(process.execPath, [path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', '.'], {
    cwd: app,
    encoding: 'utf8',
  });
  expect(execFileSync(process.execPath, ['out/main.mjs'], { cwd: app, encoding: 'utf8' })).toContain('READ ok');
  // The types resolve under node16 and bundler resolution as well.
  for (const [module, moduleResolution] of [
    ['node16', 'node16'],
    ['esnext', 'bundler'],
  ]) {
    execFileSync(
      process.execPath,
      [
        path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'),
        '--noEmit',
        '--strict',
        '--module',
        module,
        '--moduleResolution',
        moduleResolution,
        '--target',
        'ES2022',
        '--types',
        'node',
        'main.mts',
      ],
      { cwd: app, encoding: 'utf8' },
    );
  }
});

// The subpaths: what is not in the root is on nixl-node/handshake, /kv and
// /serving, with types, for require, import and TypeScript alike.
const SUBPATH_USE = [
  "const hash = computeCompatibilityHash({ vllmVersion: 'v', model: 'm', dtype: 'torch.bfloat16', numKvHeads: 8, headSize: 128, numHiddenLayers: 4, attnBackendName: 'FLASH_ATTN', cacheDtype: 'auto', isHmaEnabled: false });",
  "if (!/^[0-9a-f]{64}$/.test(hash) || wireProfile('v12').name !== 'v12' || typeof zmqHandshake.fetch !== 'function') throw new Error('handshake');",
  'if (tpRatio(4, 2) !== 2 || targetRemoteRanks(4, 1, 2).join() !== "0" || new LeaseBoard(8).slots !== 8) throw new Error("kv");',
  "if (typeof startWorker !== 'function' || typeof SyntheticModel !== 'function' || CONVERSATION_KEY !== 'conversation_id') throw new Error('serving');",
  "console.log('subpaths ok');",
].join('\n');

it('subpaths nixl-node/handshake, /kv and /serving: require, import, and TypeScript (nodenext, node16, bundler)', () => {
  const names = {
    handshake: ['computeCompatibilityHash', 'wireProfile', 'zmqHandshake'],
    kv: ['tpRatio', 'targetRemoteRanks', 'LeaseBoard'],
    serving: ['startWorker', 'SyntheticModel', 'CONVERSATION_KEY'],
  };
  const cjs = Object.entries(names)
    .map(([sub, ns]) => `const { ${ns.join(', ')} } = require('nixl-node/${sub}');`)
    .join('\n');
  fs.writeFileSync(path.join(app, 'sub.cjs'), `${cjs}\n${SUBPATH_USE}`);
  expect(execFileSync(process.execPath, ['sub.cjs'], { cwd: app, encoding: 'utf8' })).toContain('subpaths ok');
  const esm = Object.entries(names)
    .map(([sub, ns]) => `import { ${ns.join(', ')} } from 'nixl-node/${sub}';`)
    .join('\n');
  fs.writeFileSync(path.join(app, 'sub.mjs'), `${esm}\n${SUBPATH_USE}`);
  expect(execFileSync(process.execPath, ['sub.mjs'], { cwd: app, encoding: 'utf8' })).toContain('subpaths ok');
  // TypeScript: the types come with them (a wrong use fails to compile).
  strictTsApp(app, { files: ['sub.mts'] });
  fs.writeFileSync(
    path.join(app, 'sub.mts'),
    `${esm}\nimport type { KvTransferParams } from 'nixl-node/handshake';\nimport type { PullOptions, KvLayout } from 'nixl-node/kv';\nimport type { WorkerOptions, ServingModel } from 'nixl-node/serving';\nconst o: WorkerOptions = { name: 'w' };\nlet m: ServingModel | undefined; let l: KvLayout | undefined; let p: PullOptions | undefined; let k: KvTransferParams | undefined;\nvoid [o, m, l, p, k];\n${SUBPATH_USE}`,
  );
  const tsc = path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
  execFileSync(process.execPath, [tsc, '-p', '.'], { cwd: app, encoding: 'utf8' });
  expect(execFileSync(process.execPath, ['out/sub.mjs'], { cwd: app, encoding: 'utf8' })).toContain('subpaths ok');
  for (const [module, moduleResolution] of [
    ['node16', 'node16'],
    ['esnext', 'bundler'],
  ])
    execFileSync(
      process.execPath,
      [
        tsc,
        '--noEmit',
        '--strict',
        '--module',
        module,
        '--moduleResolution',
        moduleResolution,
        '--target',
        'ES2022',
        '--types',
        'node',
        'sub.mts',
      ],
      { cwd: app, encoding: 'utf8' },
    );
  // A deep path into dist is not part of the package's surface.
  fs.writeFileSync(path.join(app, 'deep.cjs'), "require('nixl-node/dist/lib/handshake/payload');");
  const deep = spawnSync(process.execPath, ['deep.cjs'], { cwd: app, encoding: 'utf8' });
  expect(deep.status).not.toBe(0);
  expect(deep.stderr).toMatch(/ERR_PACKAGE_PATH_NOT_EXPORTED/);
}, 240_000);

// linux-arm64 (Grace hosts): the cross-compiled prebuild, loaded by name by an
// arm64 Node under qemu-user. CI provides both (see .ci/run); elsewhere the
// test says what is missing.
const arm64Node = process.env.NIXL_NODE_ARM64_NODE;
const qemu = ['/usr/bin/qemu-aarch64', '/usr/bin/qemu-aarch64-static'].find((q) => fs.existsSync(q));
const armMissing = !arm64Node
  ? 'NIXL_NODE_ARM64_NODE (an arm64 node binary) is not set'
  : !qemu
    ? 'qemu-user is not installed'
    : '';
if (armMissing) console.log(`linux-arm64 test skipped: ${armMissing}`);

it.skipIf(!!armMissing)(
  'linux-arm64: the prebuild ships, loads by name under qemu, and moves bytes',
  () => {
    const pkg = path.join(app, 'node_modules', 'nixl-node');
    expect(fs.readdirSync(path.join(pkg, 'prebuilds'))).toContain('linux-arm64');
    fs.writeFileSync(
      path.join(app, 'arm64.cjs'),
      `const { NixlAgent, DescList, allocate } = require('nixl-node');\nconsole.log(process.arch);\n(async () => {${body}})().catch((e) => { console.error(e); process.exit(1); });`,
    );
    const out = execFileSync(qemu!, ['-L', '/usr/aarch64-linux-gnu', arm64Node!, 'arm64.cjs'], {
      cwd: app,
      encoding: 'utf8',
    });
    expect(out).toContain('arm64');
    expect(out).toContain('READ ok');
  },
  120_000,
);
