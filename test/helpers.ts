import { execFileSync, fork, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { once } from 'node:events';
import * as net from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { type AgentOptions, DescList, type KvLayout, NixlAgent, type NixlError, allocate, engines } from '../lib';
import { KvRejected } from '../lib/serving/models/types';

export const FIXTURES = path.join(__dirname, 'fixtures');
export const ROOT = path.join(__dirname, '..');
/** The Python the interop tests run their peers on (Debian's, where python3-msgpack and python3-zmq go). */
export const PY = '/usr/bin/python3';

/** Why PY cannot run a msgpack + pyzmq peer, or undefined when it can. */
export function pythonZmqMissing(): string | undefined {
  try {
    execFileSync(PY, ['-c', 'import msgpack, zmq'], { stdio: 'pipe' });
    return undefined;
  } catch {
    return `${PY} with msgpack and zmq not found (apt-get install python3-msgpack python3-zmq)`;
  }
}

/** A child process speaking JSON-ish messages over the IPC pipe. */
export class Peer {
  readonly proc: ChildProcess;
  #queue: unknown[] = [];
  #waiting: Array<{ resolve: (m: unknown) => void; reject: (e: Error) => void }> = [];
  /** The end of what the peer wrote to stderr (also passed through). */
  #stderr = '';
  #exited: Error | undefined;

  constructor(script: string, args: string[] = [], env: NodeJS.ProcessEnv = {}) {
    this.proc = fork(path.join(FIXTURES, script), args, {
      env: { ...process.env, ...env },
      serialization: 'advanced',
      stdio: ['ignore', 'inherit', 'pipe', 'ipc'],
    });
    this.proc.on('error', () => {});
    this.proc.stderr?.on('data', (d: Buffer) => {
      process.stderr.write(d);
      this.#stderr = (this.#stderr + d.toString('utf8')).slice(-2000);
    });
    this.proc.on('message', (m) => {
      const w = this.#waiting.shift();
      if (w) w.resolve(m);
      else this.#queue.push(m);
    });
    // A peer that dies (fails to start, crashes) fails whoever waits for it
    // with its own words, not with a timeout ('close': after its stderr is read).
    this.proc.on('close', (code, signal) => {
      // Its last words without stack frames: the error messages.
      const tail = this.#stderr
        .trim()
        .split('\n')
        .filter((l) => !/^\s+at /.test(l))
        .slice(-8)
        .join('\n');
      this.#exited = new Error(
        `peer ${script} exited (${signal ?? `code ${code}`}) before answering${tail ? `:\n${tail}` : ''}`,
      );
      for (const w of this.#waiting.splice(0)) w.reject(this.#exited);
    });
  }

  send(m: unknown): void {
    // To a dead peer: nothing (next() rejects with why it died).
    if (this.proc.connected) this.proc.send(m as never, () => {});
  }

  next<T = Record<string, unknown>>(timeoutMs = 15_000): Promise<T> {
    const m = this.#queue.shift();
    if (m !== undefined) return Promise.resolve(m as T);
    if (this.#exited) return Promise.reject(this.#exited);
    return new Promise<T>((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`peer did not answer in ${timeoutMs} ms`)), timeoutMs);
      this.#waiting.push({
        resolve: (v) => {
          clearTimeout(t);
          resolve(v as T);
        },
        reject: (e) => {
          clearTimeout(t);
          reject(e);
        },
      });
    });
  }

  /** peer.js: makes the peer's loopback agent with `size` bytes registered (filled from `seed`); its metadata and the memory's address. */
  initAgent(o: {
    name: string;
    size: number;
    shared: boolean;
    seed: number;
  }): Promise<{ md: Uint8Array; addr: bigint }> {
    return this.request<{ md: Uint8Array; addr: bigint }>({ cmd: 'init', ...o });
  }

  async request<T = Record<string, unknown>>(m: unknown): Promise<T> {
    this.send(m);
    const r = await this.next<T & { error?: string }>();
    if (r && (r as { error?: string }).error) throw new Error(`peer: ${(r as { error?: string }).error}`);
    return r;
  }

  async exit(): Promise<number | null> {
    // A process killed by a signal has no exit code, only signalCode: one
    // that already exited that way has sent its 'exit' event already.
    if (this.proc.exitCode !== null || this.proc.signalCode !== null) return this.proc.exitCode;
    const [code] = await once(this.proc, 'exit');
    return code as number | null;
  }

  kill(): void {
    this.proc.kill('SIGKILL');
  }
}

export function pattern(buf: Uint8Array, seed: number): void {
  for (let i = 0; i < buf.length; i++) buf[i] = (i * 31 + seed * 7 + (i >>> 8)) & 0xff;
}

export function checkPattern(buf: Uint8Array, seed: number, offset = 0): boolean {
  for (let i = 0; i < buf.length; i++)
    if (buf[i] !== (((i + offset) * 31 + seed * 7 + ((i + offset) >>> 8)) & 0xff)) return false;
  return true;
}

/** A TCP port that was free a moment ago on 127.0.0.1. */
export async function freePort(): Promise<number> {
  const s = net.createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()));
  const port = (s.address() as net.AddressInfo).port;
  await new Promise((r) => s.close(r));
  return port;
}

/**
 * Binds something on a port the OS just said was free, and again on another
 * when it was taken meanwhile (ports of the ephemeral range collide with other
 * sockets of a loaded machine). `start` gets the port and must reject when it
 * cannot bind it (or port + 1, ... if it binds several).
 */
export async function onFreePort<T>(start: (port: number) => Promise<T>, tries = 8): Promise<T> {
  for (let i = 0; ; i++) {
    const port = await freePort();
    try {
      return await start(port);
    } catch (e) {
      if (
        i + 1 >= tries ||
        !/EADDRINUSE|Address already in use|address in use/i.test(String((e as Error)?.message ?? e))
      )
        throw e;
    }
  }
}

/**
 * Makes `dir` a strict TypeScript app (nodenext, ES2022, Node's types from
 * this checkout), compiling `sources` (tsconfig "files" or "include") to out/.
 */
export function strictTsApp(dir: string, sources: { files?: string[]; include?: string[] }): void {
  fs.mkdirSync(path.join(dir, 'node_modules', '@types'), { recursive: true });
  const types = path.join(dir, 'node_modules', '@types', 'node');
  if (!fs.existsSync(types)) fs.symlinkSync(path.join(ROOT, 'node_modules', '@types', 'node'), types);
  const compilerOptions = {
    module: 'nodenext',
    moduleResolution: 'nodenext',
    target: 'ES2022',
    strict: true,
    outDir: 'out',
    types: ['node'],
  };
  fs.writeFileSync(path.join(dir, 'tsconfig.json'), JSON.stringify({ compilerOptions, ...sources }));
}

/**
 * A TP-1 KV layout over `mem`: `regions` regions of `blocks` blocks of
 * `blockLen` bytes each, one after another (LBHNC, 16 tokens a block).
 */
export function tp1Layout(
  engineId: string,
  mem: Buffer,
  o: { blockLen: number; blocks: number; regions: number },
): KvLayout {
  const base = DescList.from(mem).addr(0);
  return {
    engineId,
    tpSize: 1,
    tpRank: 0,
    numBlocks: o.blocks,
    blockSize: 16,
    blockLens: Array(o.regions).fill(o.blockLen),
    baseAddrs: Array.from({ length: o.regions }, (_, r) => base + BigInt(r * o.blockLen * o.blocks)),
    kvCacheLayout: 'LBHNC',
    totalNumKvHeads: 8,
  };
}

/**
 * One prefill and one decode worker and a proxy in front of them, in this
 * process; `closers` gets what closes them (in reverse order).
 */
export async function serveTrio(
  closers: Array<() => unknown>,
  o: {
    transport?: 'http' | 'zmq';
    prefill?: import('../lib/serving').WorkerOptions;
    decode?: import('../lib/serving').WorkerOptions;
    proxy?: Partial<import('../lib/serving').ProxyOptions>;
  } = {},
) {
  const { startProxy, startWorker } = await import('../lib/serving');
  const transport = o.transport ?? 'http';
  // Each closer is pushed as soon as what it closes is up: a later start that fails leaves nothing open.
  const prefill = await startWorker({ transport, ...o.prefill });
  closers.push(() => prefill.close());
  const decode = await startWorker({ transport, ...o.decode });
  closers.push(() => decode.close());
  const proxy = await startProxy({
    transport,
    prefill: [prefill.address],
    decode: [decode.address],
    healthIntervalMs: 0,
    ...o.proxy,
  });
  closers.push(() => proxy.close());
  return { prefill, decode, proxy };
}

/**
 * The keys one JSON object text repeats (in any object of it). JSON.parse
 * keeps the last of a repeated key and says nothing, as jq and most log
 * shippers do, so this reads the raw text. Throws when the text is not JSON.
 */
export function repeatedJsonKeys(text: string): string[] {
  JSON.parse(text);
  const repeated: string[] = [];
  const objects: Array<Set<string> | undefined> = [];
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === '{') objects.push(new Set());
    else if (c === '[') objects.push(undefined);
    else if (c === '}' || c === ']') objects.pop();
    else if (c === '"') {
      let j = i + 1;
      while (text[j] !== '"') j += text[j] === '\\' ? 2 : 1;
      const s = JSON.parse(text.slice(i, j + 1)) as string;
      let k = j + 1;
      while (/\s/.test(text[k] ?? '')) k++;
      const keys = objects[objects.length - 1];
      if (text[k] === ':' && keys) {
        if (keys.has(s)) repeated.push(s);
        keys.add(s);
      }
      i = j;
    }
    i++;
  }
  return repeated;
}

/** What preparedBlocks needs of an agent (NixlAgent). */
interface BlockAgent {
  readonly name: string;
  registerMemory(m: Buffer): unknown;
  getAgentMetadata(): Buffer;
  addRemoteAgent(md: Uint8Array): string;
  prepXferDlist(agent: string, descs: DescList): unknown;
}

/**
 * `n` blocks of `block` bytes registered on each of a and b (shared
 * mappings), b loaded on a, and a's lists of every block of each side.
 */
export function preparedBlocks<A extends BlockAgent>(a: A, b: BlockAgent, n: number, block: number) {
  const ma = allocate(n * block);
  const mb = allocate(n * block);
  a.registerMemory(ma);
  b.registerMemory(mb);
  a.addRemoteAgent(b.getAgentMetadata());
  const blocks = (m: Buffer) =>
    DescList.from(Array.from({ length: n }, (_, i) => m.subarray(i * block, (i + 1) * block)));
  type List = ReturnType<A['prepXferDlist']>;
  const local = a.prepXferDlist('NIXL_INIT_AGENT', blocks(ma)) as List;
  const remote = a.prepXferDlist(b.name, blocks(mb)) as List;
  return { ma, mb, local, remote };
}

/** The reason of the KvRejected that `f` throws ('accepted' when it throws nothing); any other exception fails. */
export function kvRejectedReason(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(KvRejected);
    return (e as KvRejected).reason;
  }
  return 'accepted';
}

/** The engines an engine test runs on: both, or the one NIXL_NODE_ENGINE=nixl|loopback names. */
export const wantedEngines = process.env.NIXL_NODE_ENGINE ? [process.env.NIXL_NODE_ENGINE] : ['loopback', 'nixl'];

/**
 * One suite per wanted engine (`title` names it with %s), skipped with a line
 * where NIXL is not compiled in; the agents the suite pushes on `open` are
 * closed after each test.
 */
export function eachEngine(title: string, body: (engine: string, open: NixlAgent[]) => void): void {
  describe.each(wantedEngines)(title, (engine) => {
    if (engine === 'nixl' && !engines.includes('nixl')) {
      it.skip('skipped: NIXL is not compiled in', () => {});
      return;
    }
    const open: NixlAgent[] = [];
    afterEach(() => {
      for (const a of open.splice(0)) a.close();
    });
    body(engine, open);
  });
}

/**
 * An agent on `engine` as the engine suites make them (NIXL: UCX over shared
 * memory with its progress thread), pushed on `open` to be closed after the test.
 */
export function engineAgent(engine: string, open: NixlAgent[], name: string, extra: AgentOptions = {}): NixlAgent {
  const base: AgentOptions =
    engine === 'nixl'
      ? {
          engine,
          progressThread: true,
          progressDelayUs: 1000,
          backendParams: { UCX: { ucx_error_handling_mode: 'none' } },
        }
      : { engine: 'loopback' };
  if (engine === 'nixl') process.env.UCX_TLS ??= 'sm,self';
  const a = new NixlAgent(name, { ...base, ...extra });
  open.push(a);
  return a;
}

/** 'resolved', 'rejected CODE', or 'pending' if p has not settled within `ms`. */
export function settledWithin<T>(p: Promise<T>, ms: number): Promise<string> {
  return Promise.race([
    p.then(
      () => 'resolved',
      (e: NixlError) => `rejected ${e.code}`,
    ),
    new Promise<string>((r) => setTimeout(() => r('pending'), ms)),
  ]);
}
