// Two hosts on one machine: network namespaces joined by a veth pair (made
// here, removed after). The prefill runs in one, the decode in the other,
// the side channel bound to the veth address, and KV moves over NIXL with UCX
// over TCP, every byte verified. Skipped, saying why, when NIXL is not
// compiled in or namespaces cannot be made (not root, no iproute2).
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { once } from 'node:events';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { engines } from '../../lib';
import { modelPath } from '../../lib/serving/models/test-models';
import { OneProcess } from '../../demo/llama-reference';
import { FIXTURES, ROOT } from '../helpers';

const tag = (process.pid % 10000).toString();
const NS = { p: `nxp${tag}`, d: `nxd${tag}` };
const VETH = { p: `vp${tag}`, d: `vd${tag}` };
const subnet = `10.${200 + (process.pid % 50)}.${process.pid % 250}`;
const ADDR = { p: `${subnet}.1`, d: `${subnet}.2` };

function ip(...args: string[]): void {
  execFileSync('ip', args, { stdio: ['ignore', 'ignore', 'pipe'] });
}

function whySkip(): string | undefined {
  if (!engines.includes('nixl')) return 'NIXL is not compiled in (build with NIXL_PREFIX=<nixl install>)';
  try {
    ip('netns', 'add', NS.p);
    ip('netns', 'add', NS.d);
    ip('link', 'add', VETH.p, 'type', 'veth', 'peer', 'name', VETH.d);
    ip('link', 'set', VETH.p, 'netns', NS.p);
    ip('link', 'set', VETH.d, 'netns', NS.d);
    for (const [ns, dev, addr] of [
      [NS.p, VETH.p, ADDR.p],
      [NS.d, VETH.d, ADDR.d],
    ]) {
      ip('-n', ns, 'addr', 'add', `${addr}/24`, 'dev', dev);
      ip('-n', ns, 'link', 'set', dev, 'up');
      ip('-n', ns, 'link', 'set', 'lo', 'up');
    }
    return undefined;
  } catch (e) {
    cleanup();
    return `network namespaces cannot be made here: ${
      String((e as { stderr?: Buffer }).stderr ?? e)
        .trim()
        .split('\n')[0]
    }`;
  }
}

function cleanup(): void {
  for (const ns of [NS.p, NS.d]) {
    try {
      ip('netns', 'del', ns); // takes its end of the veth pair (and so the pair) with it
    } catch {
      /* not made */
    }
  }
}

let skip: string | undefined;
beforeAll(() => {
  skip = whySkip();
  if (skip) console.warn(`two-namespace test skipped: ${skip}`);
});
afterAll(cleanup);

/** A fixture run inside a namespace, with its IPC channel. */
function inNs(ns: string, fixture: string, spec: object): ChildProcess {
  return spawn('ip', ['netns', 'exec', ns, process.execPath, path.join(FIXTURES, fixture), JSON.stringify(spec)], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    // UCX over the veth (TCP); NIXL's libraries as this process found them.
    env: { ...process.env, UCX_TLS: 'tcp', UCX_NET_DEVICES: ns === NS.p ? VETH.p : VETH.d },
  });
}

describe('two hosts on one machine (network namespaces, veth, NIXL over UCX TCP)', () => {
  it('prefill in one namespace, decode in the other: every byte verified, blocks freed', async (ctx) => {
    if (skip) ctx.skip();
    const spec = { heads: 8, headBytes: 1024, numBlocks: 32, regions: 4, method: 'zmq', engine: 'nixl' };
    const prefill = inNs(NS.p, 'prefill-kv.js', { ...spec, tpSize: 2, host: ADDR.p });
    let decodes: ChildProcess[] = [];
    try {
      const [{ port }] = (await once(prefill, 'message')) as [{ port: number }];
      // Releases may come while the decodes still report: collect them from now on.
      const released: string[][] = [];
      prefill.on('message', (m: { released?: string[] }) => {
        if (m.released) released.push(m.released);
      });
      const pulls = [
        { requestId: 'ns-a', local: [0, 1, 2, 3, 4, 5, 6, 7], remote: [8, 9, 10, 11, 12, 13, 14, 15] },
        { requestId: 'ns-b', local: [20, 9, 30], remote: [1, 31, 17] },
      ];
      for (const p of pulls) prefill.send({ cmd: 'expect', requestId: p.requestId, blockIds: p.remote });
      decodes = [0, 1].map((r) =>
        inNs(NS.d, 'decode-kv.js', { ...spec, tpSize: 2, tpRank: r, port, prefillTp: 2, host: ADDR.p, pulls }),
      );
      const reports = await Promise.all(
        decodes.map(
          async (d) =>
            ((await once(d, 'message')) as [{ results: Array<{ ok: boolean; bad?: number; bytes?: number }> }])[0],
        ),
      );
      for (const rep of reports)
        for (const r of rep.results) {
          expect(r.ok, JSON.stringify(r)).toBe(true);
          expect(r.bad).toBe(0);
          expect(r.bytes).toBeGreaterThan(0);
        }
      await expect.poll(() => released.length, { timeout: 30_000 }).toBe(pulls.length);
      for (const r of released) expect(r).toEqual(['read', 'read']);
      await Promise.all(decodes.map((d) => (d.exitCode === null ? once(d, 'exit') : undefined)));
    } finally {
      for (const d of decodes) if (d.exitCode === null) d.kill('SIGKILL');
      prefill.send({ cmd: 'exit' });
      if (prefill.exitCode === null) await once(prefill, 'exit');
    }
  }, 120_000);
});

/** A nixl-node command inside a namespace; resolves with its JSON ready line. */
async function commandInNs(ns: string, args: string[], procs: ChildProcess[]): Promise<Record<string, unknown>> {
  const p = spawn('ip', ['netns', 'exec', ns, process.execPath, path.join(ROOT, 'bin/nixl-node.js'), ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, UCX_TLS: 'tcp', UCX_NET_DEVICES: ns === NS.p ? VETH.p : VETH.d, NIXL_NODE_ENGINE: 'nixl' },
  });
  procs.push(p);
  let err = '';
  p.stderr!.on('data', (d) => {
    err = (err + d).slice(-4000);
  });
  return new Promise((resolve, reject) => {
    readline.createInterface({ input: p.stdout! }).on('line', (l) => {
      if (l.startsWith('{"ready"')) resolve(JSON.parse(l));
    });
    p.once('exit', (c) => reject(new Error(`nixl-node ${args[0]} in ${ns} exited (${c}): ${err}`)));
  });
}

describe('a real model across two hosts (network namespaces, NIXL over UCX TCP)', () => {
  it('llama prefill in one namespace, decode and proxy in the other: answers identical to one process', async (ctx) => {
    if (skip) ctx.skip();
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-netns-llama-'));
    const gguf = modelPath('tiny', dir);
    const modelArgs = ['--model', gguf, '--threads', '1', '--context-size', '2048', '--block-kib', '4'];
    const procs: ChildProcess[] = [];
    try {
      const [pre, dec] = await Promise.all([
        commandInNs(NS.p, ['worker', '--host', ADDR.p, ...modelArgs], procs),
        commandInNs(NS.d, ['worker', '--host', ADDR.d, ...modelArgs], procs),
      ]);
      const proxy = await commandInNs(
        NS.d,
        ['proxy', '--host', ADDR.d, '--port', '0', '--prefill', String(pre.address), '--decode', String(dec.address)],
        procs,
      );
      const prompts = Array.from({ length: 20 }, (_, i) => `request ${i}: ${'the cat sat on a mat '.repeat(1 + i)}`);
      // The client runs in the decode's namespace too: this one cannot reach it.
      const client = `(async () => { const out = []; for (const p of ${JSON.stringify(prompts)}) {
        const r = await fetch('${proxy.url}/v1/completions', { method: 'POST', body: JSON.stringify({ prompt: p, max_tokens: 12, temperature: 0 }) });
        const j = await r.json(); out.push({ status: r.status, text: j.choices?.[0]?.text, info: j.nixl_node, error: j.error }); }
        console.log(JSON.stringify(out)); })()`;
      const answers = JSON.parse(
        execFileSync('ip', ['netns', 'exec', NS.d, process.execPath, '-e', client], { encoding: 'utf8' }),
      ) as Array<{ status: number; text: string; info: Record<string, unknown>; error?: unknown }>;
      const ref = await OneProcess.load(gguf, { contextSize: 2048, threads: 1 });
      try {
        for (const [i, a] of answers.entries()) {
          expect(a.status, JSON.stringify(a.error)).toBe(200);
          expect(a.info.kv_moved).toBe(true);
          expect(a.text).toBe((await ref.generate({ chat: false, text: prompts[i], maxTokens: 12 })).text);
        }
      } finally {
        await ref.close();
      }
    } finally {
      for (const p of procs) if (p.exitCode === null) p.kill('SIGKILL');
      fs.rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);
});
