// The operator's side of serving (issue 37): worker addresses checked at
// start, structured logs (JSON lines, request ids, workers going unhealthy,
// ejected, back), a ZeroMQ proxy that exits on a signal and leaks no socket
// per health check, and prefill / decode workers of different models never
// paired.
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterEach, describe, expect, it } from 'vitest';
import { NixlAgent } from '../../lib';
import { startProxy, startWorker, SyntheticModel, Worker } from '../../lib/serving';
import { HttpTransport } from '../../lib/serving/proxy/transports/http';
import { ZmqTransport } from '../../lib/serving/proxy/transports/zmq';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';
import { freePort, repeatedJsonKeys, ROOT } from '../helpers';

const BIN = path.join(ROOT, 'bin', 'nixl-node.js');
const closers: Array<() => unknown> = [];
const procs: ChildProcess[] = [];
afterEach(async () => {
  for (const p of procs.splice(0)) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
  for (const c of closers.splice(0).reverse()) await c();
});

const cli = (args: string[], env: Record<string, string> = {}) =>
  spawnSync(process.execPath, [BIN, ...args], { encoding: 'utf8', timeout: 20_000, env: { ...process.env, ...env } });

/** A nixl-node command, its stdout JSON lines and its stderr log lines as they come. */
function command(args: string[]) {
  const p = spawn(process.execPath, [BIN, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  procs.push(p);
  const out: Array<Record<string, unknown>> = [];
  const log: Array<Record<string, unknown>> = [];
  /** stderr as it came, line by line. */
  const raw: string[] = [];
  const json = (into: typeof out) => (l: string) => {
    try {
      into.push(JSON.parse(l));
    } catch {
      into.push({ text: l });
    }
  };
  readline.createInterface({ input: p.stdout! }).on('line', json(out));
  readline.createInterface({ input: p.stderr! }).on('line', (l) => {
    raw.push(l);
    json(log)(l);
  });
  const exited = new Promise<number | null>((r) => p.once('exit', (c) => r(c)));
  return { p, out, log, raw, exited };
}

describe('worker addresses are checked when the proxy starts', () => {
  it.each([
    [
      ['--prefill', '127.0.0.1:33585', '--decode', 'http://127.0.0.1:33586'],
      /'127\.0\.0\.1:33585': no scheme \(write http:\/\/127\.0\.0\.1:33585\)/,
    ],
    [['--prefill', 'http://127.0.0.1:99999', '--decode', 'http://127.0.0.1:1'], /port '99999'/],
    [
      ['--prefill', 'http://127.0.0.1:1', '--decode', 'tcp://127.0.0.1:2'],
      /a ZeroMQ address, but the transport is http/,
    ],
    [
      ['--transport', 'zmq', '--prefill', 'http://127.0.0.1:1234', '--decode', 'http://127.0.0.1:1235'],
      /an HTTP URL, but the transport is zmq/,
    ],
    [
      ['--transport', 'zmq', '--prefill', 'tcp://127.0.0.1', '--decode', 'tcp://127.0.0.1:2'],
      /expected tcp:\/\/host:port/,
    ],
    [['--transport', 'zmq', '--pd-addrs', '127.0.0.1:5555'], /no scheme \(write tcp:\/\/127\.0\.0\.1:5555\)/],
  ])('proxy %j: one line naming the address, exit code 2', (args, message) => {
    const r = cli(['proxy', '--port', '0', ...args]);
    expect(r.status, r.stderr).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(message)]);
  });

  it('the library refuses them too (NIXL_ERR_INVALID_PARAM), and takes a URL with a trailing slash', async () => {
    await expect(startProxy({ prefill: ['localhost:8000'], decode: ['http://localhost:8001'] })).rejects.toMatchObject({
      code: 'NIXL_ERR_INVALID_PARAM',
    });
    const w = await startWorker();
    closers.push(() => w.close());
    const p = await startProxy({ prefill: [`${w.address}/`], decode: [w.address], healthIntervalMs: 0 });
    closers.push(() => p.close());
    expect(p.pools.prefill.workers[0].address).toBe(w.address);
  });
});

describe('a ZeroMQ proxy whose workers it cannot connect to', () => {
  it('leaks no socket per health check, and its process ends once the transport is closed', () => {
    // In a process of its own: its file descriptors, and whether it ends by itself.
    const script = `
      const fs = require('node:fs');
      const { ZmqTransport } = require(${JSON.stringify(path.join(ROOT, 'dist/lib/serving/proxy/transports/zmq'))});
      (async () => {
        const t = await new ZmqTransport().bind();
        const fds = () => fs.readdirSync('/proc/self/fd').length;
        const w = { address: 'http://127.0.0.1:1234', stage: 'decode', healthy: true, outstanding: 0, failures: 0 };
        const before = fds();
        for (let i = 0; i < 300; i++) if (await t.health(w, 1000)) throw new Error('healthy?');
        // A closed socket's descriptors go back asynchronously (ZeroMQ's reaper): wait for them.
        for (let i = 0; i < 40 && fds() - before >= 10; i++) await new Promise((r) => setTimeout(r, 50));
        console.log(JSON.stringify({ grew: fds() - before }));
        await t.close();
      })();`;
    const t0 = performance.now();
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', timeout: 15_000 });
    expect(r.signal, 'the process did not end by itself').toBeNull();
    expect(r.status, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout).grew).toBeLessThan(10);
    expect(performance.now() - t0).toBeLessThan(15_000);
  }, 20_000);

  it.each(['SIGTERM', 'SIGINT'] as const)(
    'nixl-node proxy --transport zmq exits on %s within seconds',
    async (sig) => {
      const [a, b] = [await freePort(), await freePort()];
      const c = command([
        'proxy',
        '--port',
        '0',
        '--transport',
        'zmq',
        '--prefill',
        `tcp://127.0.0.1:${a}`,
        '--decode',
        `tcp://127.0.0.1:${b}`,
        '--health-ms',
        '50',
      ]);
      await expect.poll(() => c.out.some((l) => l.ready), { timeout: 10_000 }).toBe(true);
      await new Promise((r) => setTimeout(r, 500)); // health checks of workers that are not there
      const t0 = performance.now();
      c.p.kill(sig);
      expect(await c.exited).toBe(0);
      expect(performance.now() - t0).toBeLessThan(5000);
      expect(c.out.some((l) => l.stopped)).toBe(true);
    },
    20_000,
  );

  it('the transport closes sockets whose connect() threw (HttpTransport has none)', async () => {
    const t = await new ZmqTransport().bind();
    const w = { address: 'http://x', stage: 'decode' as const, healthy: true, outstanding: 0, failures: 0 };
    expect(await t.health(w, 200)).toBe(false);
    await t.close();
    expect(await new HttpTransport().health(w, 200)).toBe(false);
  });
});

// A supervisor that signals a command the moment its ready line is out must
// get the graceful stop (exit 0, the stopped line), not the default action
// that kills it. The child signals itself right after writing the line, so
// the window between the line and the handlers is hit every run.
const SIGNAL_AT_READY = `
const [sig, ...args] = process.argv.slice(1);
const log = console.log;
console.log = (...a) => {
  log(...a);
  if (/"ready":true|Ctrl-C stops/.test(String(a[0]))) for (const s of sig.split(',')) process.kill(process.pid, s);
};
process.argv = [process.argv[0], 'nixl-node', ...args];
require(${JSON.stringify(BIN)});
`;

describe('a signal the moment the ready line is out', () => {
  const commands: Array<[string, string[], RegExp]> = [
    ['worker', ['worker', '--port', '0'], /"stopped":true/],
    [
      'proxy',
      ['proxy', '--port', '0', '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'],
      /"stopped":true/,
    ],
    [
      'sidechannel serve',
      ['sidechannel', 'serve', '--port', '0', '--tp-size', '1', '--synthetic'],
      /^served 0, refused 0$/m,
    ],
  ];
  it.each(commands)(
    '%s: SIGTERM stops it cleanly, exit 0',
    async (_name, args, stopped) => {
      const r = spawnSync(process.execPath, ['-e', SIGNAL_AT_READY, 'SIGTERM', ...args], {
        encoding: 'utf8',
        timeout: 20_000,
      });
      expect(r.signal, r.stderr).toBeNull();
      expect(r.status, r.stderr).toBe(0);
      expect(r.stdout).toMatch(stopped);
    },
    25_000,
  );

  it('worker: SIGUSR2 at once prints its stats and keeps it running', async () => {
    const r = spawnSync(process.execPath, ['-e', SIGNAL_AT_READY, 'SIGUSR2,SIGTERM', 'worker', '--port', '0'], {
      encoding: 'utf8',
      timeout: 20_000,
    });
    expect(r.signal, r.stderr).toBeNull();
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/"freeBlocks"/);
    expect(r.stdout).toMatch(/"stopped":true/);
  }, 25_000);
});

describe('logs: pino JSON lines on stderr, with request ids', () => {
  it('the proxy logs each request, a worker going unhealthy and coming back; --log-level chooses', async () => {
    const port = await freePort();
    const pre = await startWorker();
    let dec = await startWorker({ port });
    closers.push(
      () => pre.close(),
      () => dec.close(),
    );
    const c = command([
      'proxy',
      '--port',
      '0',
      '--prefill',
      pre.address,
      '--decode',
      dec.address,
      '--health-ms',
      '100',
    ]);
    await expect.poll(() => c.out.find((l) => l.ready), { timeout: 10_000 }).toBeTruthy();
    const url = String(c.out.find((l) => l.ready)!.url);
    const r = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'x-request-id': 'client-7' },
      body: JSON.stringify({ prompt: 'log me', max_tokens: 2 }),
    });
    expect(r.status).toBe(200);
    await expect
      .poll(() => c.log.find((l) => l.msg === 'request'), { timeout: 5000 })
      .toMatchObject({ level: 30, req_id: 'client-7', route: '/v1/completions', status: 200, name: 'nixl-node-proxy' });
    expect(typeof c.log.find((l) => l.msg === 'request')!.time).toBe('string');
    await dec.close();
    await expect
      .poll(() => c.log.find((l) => String(l.msg).startsWith('worker unhealthy')), { timeout: 5000 })
      .toMatchObject({ level: 40, stage: 'decode', worker: dec.address });
    dec = await startWorker({ port });
    await expect
      .poll(() => c.log.find((l) => l.msg === 'worker healthy again'), { timeout: 5000 })
      .toMatchObject({ level: 30, stage: 'decode', worker: dec.address, model: MODEL_NAME });
    // Only transitions are logged, not every failed round.
    expect(c.log.filter((l) => String(l.msg).startsWith('worker unhealthy'))).toHaveLength(1);
    expect(
      c.log.every((l) => typeof l.level === 'number'),
      JSON.stringify(c.log),
    ).toBe(true);
    c.p.kill('SIGTERM');
    await c.exited;

    const quiet = command([
      'proxy',
      '--port',
      '0',
      '--prefill',
      pre.address,
      '--decode',
      dec.address,
      '--log-level',
      'warn',
    ]);
    await expect.poll(() => quiet.out.some((l) => l.ready), { timeout: 10_000 }).toBe(true);
    const url2 = String(quiet.out.find((l) => l.ready)!.url);
    expect((await fetch(`${url2}/v1/completions`, { method: 'POST', body: '{"prompt":"x"}' })).status).toBe(200);
    quiet.p.kill('SIGTERM');
    await quiet.exited;
    expect(quiet.log).toEqual([]);
    expect(cli(['proxy', '--log-level', 'loud', '--pd-addrs', 'http://127.0.0.1:1']).stderr).toMatch(
      /--log-level must be one of trace, debug, info, warn, error, fatal, silent/,
    );
  }, 30_000);

  it('an embedded proxy logs to the logger it is given (a failed request ejects its worker, with the reason)', async () => {
    const lines: Array<{ level: string; fields: Record<string, unknown>; msg?: string }> = [];
    const at = (level: string) => (fields: object, msg?: string) =>
      void lines.push({ level, fields: fields as Record<string, unknown>, msg });
    const logger = { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') };
    const pre = await startWorker();
    closers.push(() => pre.close());
    const gone = `http://127.0.0.1:${await freePort()}`;
    const p = await startProxy({ prefill: [pre.address, gone], decode: [pre.address], healthIntervalMs: 0, logger });
    closers.push(() => p.close());
    for (let i = 0; i < 2; i++)
      expect((await fetch(`${p.url}/v1/completions`, { method: 'POST', body: '{"prompt":"x"}' })).status).toBe(200);
    expect(lines.find((l) => l.msg === 'worker ejected')).toMatchObject({
      level: 'warn',
      fields: { stage: 'prefill', worker: gone, reason: expect.stringMatching(/^unreachable: /) },
    });
    expect(lines.filter((l) => l.msg === 'request')).toHaveLength(2);
  });

  it('a worker logs refused requests; the library writes nothing to stderr on its own', async () => {
    const c = command(['worker', '--log-level', 'debug']);
    await expect.poll(() => c.out.find((l) => l.ready), { timeout: 10_000 }).toBeTruthy();
    const address = String(c.out.find((l) => l.ready)!.address);
    expect(c.log.find((l) => l.msg === 'worker ready')).toMatchObject({ level: 30, address });
    const r = await fetch(`${address}/v1/completions`, {
      method: 'POST',
      headers: { 'x-request-id': 'w-1' },
      body: JSON.stringify({ prompt: 'x', max_tokens: 2, model: 'nope' }),
    });
    expect(r.status).toBe(404);
    await expect
      .poll(() => c.log.find((l) => l.msg === 'request refused'), { timeout: 5000 })
      .toMatchObject({ request_id: 'w-1', status: 404 });
    c.p.kill('SIGTERM');
    await c.exited;
    // An agent on a build without NIXL: no line on stderr (nixl-node info says which engines there are).
    const r2 = spawnSync(
      process.execPath,
      [
        '-e',
        `const { NixlAgent } = require(${JSON.stringify(path.join(ROOT, 'dist/lib'))}); new NixlAgent('quiet').close();`,
      ],
      { encoding: 'utf8', env: { ...process.env, NIXL_NODE_ENGINE: '' } },
    );
    expect(r2.status, r2.stderr).toBe(0);
    expect(r2.stderr).toBe('');
    void NixlAgent;
  }, 20_000);
});

describe('log lines are JSON a log shipper keeps whole (issue 44)', () => {
  it('every stderr line of a worker and of a proxy is one JSON object with no key twice', async () => {
    const w = command(['worker', '--name', 'prefill-0', '--log-level', 'debug']);
    await expect.poll(() => w.out.find((l) => l.ready), { timeout: 10_000 }).toBeTruthy();
    const address = String(w.out.find((l) => l.ready)!.address);
    const p = command(['proxy', '--port', '0', '--pd-addrs', address, '--health-ms', '100', '--log-level', 'debug']);
    await expect.poll(() => p.out.find((l) => l.ready), { timeout: 10_000 }).toBeTruthy();
    const url = String(p.out.find((l) => l.ready)!.url);
    expect(
      (await fetch(`${url}/v1/completions`, { method: 'POST', body: '{"prompt":"x","max_tokens":2}' })).status,
    ).toBe(200);
    expect(
      (await fetch(`${address}/v1/completions`, { method: 'POST', body: '{"prompt":"x","model":"no"}' })).status,
    ).toBe(404);
    await expect.poll(() => w.raw.some((l) => l.includes('request refused')), { timeout: 5000 }).toBe(true);
    w.p.kill('SIGTERM');
    await w.exited;
    await expect.poll(() => p.raw.some((l) => l.includes('worker unhealthy')), { timeout: 5000 }).toBe(true);
    p.p.kill('SIGTERM');
    await p.exited;
    for (const [who, lines] of [
      ['worker', w.raw],
      ['proxy', p.raw],
    ] as const) {
      expect(lines.length).toBeGreaterThan(2);
      for (const line of lines) expect(repeatedJsonKeys(line), `${who}: ${line}`).toEqual([]);
    }
    // The worker's own name has a key of its own; `name` is the logger's.
    const ready = JSON.parse(w.raw.find((l) => l.includes('worker ready'))!);
    expect(ready).toMatchObject({ name: 'nixl-node-worker', worker: 'prefill-0', address });
  }, 30_000);
});

describe('a failed health check says why (issue 44)', () => {
  it('ECONNREFUSED, a timeout, the status and reason a worker answered', async () => {
    const lines: Array<{ fields: Record<string, unknown>; msg?: string }> = [];
    const at = (fields: object, msg?: string) => void lines.push({ fields: fields as Record<string, unknown>, msg });
    const logger = { debug: at, info: at, warn: at, error: at };
    const silent = http.createServer(() => {}); // takes the request, never answers
    const sick = http.createServer((_req, res) => {
      res.writeHead(503, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ status: 'unavailable', reason: 'no context can be made' }));
    });
    for (const s of [silent, sick]) {
      await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
      closers.push(() => {
        s.closeAllConnections();
        return new Promise((r) => s.close(r));
      });
    }
    const urlOf = (s: http.Server) => `http://127.0.0.1:${(s.address() as import('node:net').AddressInfo).port}`;
    const dec = await startWorker();
    closers.push(() => dec.close());
    const refused = `http://127.0.0.1:${await freePort()}`;
    const p = await startProxy({
      prefill: [refused, urlOf(silent), urlOf(sick)],
      decode: [dec.address],
      healthIntervalMs: 0,
      logger,
    });
    closers.push(() => p.close());
    await p.checkHealth();
    const cause = (worker: string) =>
      lines.find((l) => l.msg?.startsWith('worker unhealthy') && l.fields.worker === worker)?.fields.cause;
    expect(cause(refused)).toBe('ECONNREFUSED');
    expect(cause(urlOf(silent))).toMatch(/timeout/);
    expect(cause(urlOf(sick))).toBe('HTTP 503: no context can be made');
  });
});

/** The synthetic model under another name: the proxy must not pair it with the default one. */
class OtherModel extends SyntheticModel {
  override readonly id = 'other/model';
}

describe.each(['http', 'zmq'] as const)('workers of different models (%s)', (transport) => {
  it('are never paired: 503 naming both models, an error log line, /health not ok', async () => {
    const lines: Array<{ fields: object; msg?: string }> = [];
    const log = (fields: object, msg?: string) => void lines.push({ fields, msg });
    const logger = { debug() {}, info() {}, warn: log, error: log };
    const pre = await startWorker({ transport });
    const other = await new Worker({ transport }, new OtherModel()).start();
    closers.push(
      () => pre.close(),
      () => other.close(),
    );
    const p = await startProxy({
      transport,
      prefill: [pre.address],
      decode: [other.address],
      healthIntervalMs: 200,
      logger,
    });
    closers.push(() => p.close());
    const r = await fetch(`${p.url}/v1/completions`, { method: 'POST', body: '{"prompt":"x","max_tokens":2}' });
    const body = (await r.json()) as { error: { message: string; code: string } };
    expect(r.status).toBe(503);
    expect(body.error.code).toBe('model_mismatch');
    expect(body.error.message).toContain(`'${MODEL_NAME}'`);
    expect(body.error.message).toContain("'other/model'");
    expect(pre.stats.prefills).toBe(0);
    const h = await fetch(`${p.url}/health`);
    expect(h.status).toBe(503);
    expect(((await h.json()) as { error: string }).error).toMatch(/model mismatch/);
    expect(lines.filter((l) => /model mismatch/.test(l.msg ?? ''))).toHaveLength(1);
  });

  it('with both models on both sides, each request goes to a pair of its model', async () => {
    const ws = await Promise.all([
      startWorker({ transport }),
      new Worker({ transport }, new OtherModel()).start(),
      startWorker({ transport }),
      new Worker({ transport }, new OtherModel()).start(),
    ]);
    for (const w of ws) closers.push(() => w.close());
    const p = await startProxy({
      transport,
      prefill: [ws[0].address, ws[1].address],
      decode: [ws[2].address, ws[3].address],
      healthIntervalMs: 10_000,
    });
    closers.push(() => p.close());
    for (let i = 0; i < 8; i++) {
      const model = i % 2 ? MODEL_NAME : 'other/model';
      const r = await fetch(`${p.url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ prompt: `p${i}`, max_tokens: 2, model }),
      });
      expect(r.status, await r.clone().text()).toBe(200);
      expect(((await r.json()) as { model: string }).model).toBe(model);
    }
    // A request naming no model still gets a pair of one model.
    for (let i = 0; i < 4; i++)
      expect((await fetch(`${p.url}/v1/completions`, { method: 'POST', body: '{"prompt":"any"}' })).status).toBe(200);
    expect((await fetch(`${p.url}/health`)).status).toBe(200);
  });
});

it('nixl-node --version, and --help names what the worker serves', () => {
  const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as { version: string };
  expect(cli(['--version']).stdout.trim()).toBe(pkg.version);
  const help = cli(['--help']).stdout;
  expect(help).toMatch(/worker .*GGUF/s);
  expect(help).not.toMatch(/synthetic model, for the proxy/);
  expect(help).toContain('--version');
});

it('worker --help lists no test hook (they are flags tests start workers with, grouped under testHooks)', () => {
  const help = cli(['worker', '--help']).stdout;
  expect(help).toContain('--kv-mode');
  for (const hook of ['--stall-prefill-ms', '--stall-decode-ms', '--poison-freed', '--clock-skew-ms', '--tamper-kv'])
    expect(help, hook).not.toContain(hook);
});

it('an address in use: the message names it, says EADDRINUSE and which options choose it', async () => {
  const port = await freePort();
  const w = await startWorker({ port });
  closers.push(() => w.close());
  for (const args of [
    ['worker', '--port', String(port)],
    ['worker', '--side-channel-port', String(port)],
    ['proxy', '--port', String(port), '--pd-addrs', w.address],
  ]) {
    const r = cli(args);
    expect(r.status, r.stderr).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([
      expect.stringMatching(new RegExp(`127\\.0\\.0\\.1:${port}.*EADDRINUSE.*choose another with --`)),
    ]);
  }
  const z = cli(['worker', '--transport', 'zmq', '--zmq-addr', `tcp://127.0.0.1:${port}`]);
  expect(z.stderr).toMatch(new RegExp(`tcp://127\\.0\\.0\\.1:${port} is already in use \\(EADDRINUSE\\).*--zmq-addr`));
}, 30_000);

describe('node-llama-cpp, an optional peer dependency', () => {
  it('is declared as one, at the exact version the GGUF workers check for', async () => {
    const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'));
    const { NODE_LLAMA_CPP } = await import('../../lib/serving');
    expect(`node-llama-cpp@${pkg.peerDependencies['node-llama-cpp']}`).toBe(NODE_LLAMA_CPP);
    expect(pkg.peerDependenciesMeta['node-llama-cpp']).toEqual({ optional: true });
    expect(pkg.dependencies['node-llama-cpp']).toBeUndefined();
  });

  it('another release is refused at start, naming the one to install', async () => {
    const { checkNodeLlamaCppVersion, loadNodeLlamaCpp } = await import('../../lib/serving/models/node-llama-cpp');
    for (const v of ['3.20.0', '4.0.0', undefined]) {
      let e: { code?: string; message?: string } = {};
      try {
        checkNodeLlamaCppVersion(v);
      } catch (x) {
        e = x as typeof e;
      }
      expect(e.code).toBe('NIXL_ERR_NOT_SUPPORTED');
      expect(e.message).toMatch(/need exactly 3\.21\.1: npm i -E node-llama-cpp@3\.21\.1$/);
    }
    expect(() => checkNodeLlamaCppVersion('3.21.1')).not.toThrow();
    expect(typeof (await loadNodeLlamaCpp()).getLlama).toBe('function');
  });
});

it('the command brings what it needs for traces and /metrics: optional dependencies, not peers to install by hand', () => {
  const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'));
  for (const name of [
    '@opentelemetry/sdk-trace-base',
    '@opentelemetry/exporter-trace-otlp-http',
    '@opentelemetry/resources',
    'prom-client',
  ]) {
    expect(pkg.optionalDependencies[name], name).toMatch(/^\d+\.\d+\.\d+$/);
    expect(pkg.peerDependencies[name], name).toBeUndefined();
  }
  // The library itself imports only the API, as an optional peer.
  expect(pkg.peerDependenciesMeta['@opentelemetry/api']).toEqual({ optional: true });
  expect(pkg.dependencies.pino).toMatch(/^\d+\.\d+\.\d+$/);
});
