// The serving proxy alone: `nixl-node proxy` (its own process, default log
// level, tracing off) in front of fake prefill and decode workers (processes
// of their own, no model work: fake-workers.ts), against the client calling
// the prefill and then the decode itself on the same workers. The proxy
// reaches them over HTTP, then over ZeroMQ. Modes alternate round by round;
// every answer is checked. Reported: requests/s, p50 and p99 latency, and the
// proxy process's CPU per request (user + system, from /proc).
import { type ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as http from 'node:http';
import * as os from 'node:os';
import * as path from 'node:path';
import { type LoadResult, directAsk, proxyAsk, runLoad } from './proxy-load';
import { median, percentile } from './stats';

export interface ProxyRow {
  mode: string;
  requestsPerSecond: number;
  min: number;
  max: number;
  p50Ms: number;
  p99Ms: number;
  /** The proxy process's CPU per request, µs (undefined: no proxy, or no /proc). */
  cpuUsPerRequest?: number;
  /** Median over rounds of requests/s / the direct client's in the same round. */
  ratio: number;
  /** Median over rounds of p99 / the direct client's. */
  p99Ratio: number;
  /** Answers checked, and how many were wrong (or failed). */
  checked: number;
  wrong: number;
}

export interface ProxyResult {
  rows: ProxyRow[];
  requests: number;
  concurrency: number;
  rounds: number;
  loadAverage: number[];
  reasons?: string[];
}

const root = path.join(__dirname, '..', '..');

/** Starts a node script; resolves with its first JSON line on stdout. */
export async function spawnReady(
  args: string[],
  env: NodeJS.ProcessEnv = {},
): Promise<{ child: ChildProcess; ready: Record<string, unknown> }> {
  const child = spawn(process.execPath, args, {
    cwd: root,
    stdio: ['ignore', 'pipe', 'ignore'],
    env: { ...process.env, ...env },
  });
  const ready = await new Promise<Record<string, unknown>>((resolve, reject) => {
    let buf = '';
    const t = setTimeout(() => reject(new Error(`${args.join(' ')}: no ready line in 20 s`)), 20_000);
    child.once('exit', (code) => reject(new Error(`${args.join(' ')} exited ${code} before its ready line`)));
    child.stdout!.on('data', (d: Buffer) => {
      buf += d.toString();
      const nl = buf.indexOf('\n');
      if (nl < 0) return;
      clearTimeout(t);
      try {
        resolve(JSON.parse(buf.slice(0, nl)));
      } catch (e) {
        reject(e);
      }
    });
  });
  child.stdout!.resume();
  return { child, ready };
}

/** User + system CPU of a process so far, µs (Linux /proc; undefined elsewhere). */
export function cpuMicros(pid: number | undefined): number | undefined {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return ((Number(f[11]) + Number(f[12])) * 1e6) / 100; // utime, stime in USER_HZ (100)
  } catch {
    return undefined;
  }
}

export async function benchProxy(requests: number, rounds: number, concurrency = 32): Promise<ProxyResult> {
  const fake = path.join(root, 'dist', 'bench', 'fake-workers.js');
  const cli = path.join(root, 'dist', 'cli', 'nixl-node.js');
  const children: ChildProcess[] = [];
  const agent = new http.Agent({ keepAlive: true, maxSockets: concurrency });
  try {
    const pre = await spawnReady([fake, 'prefill']);
    children.push(pre.child);
    const dec = await spawnReady([fake, 'decode']);
    children.push(dec.child);
    const env = { NIXL_NODE_LOG_LEVEL: '', OTEL_EXPORTER_OTLP_ENDPOINT: '' };
    const proxies: Array<{ mode: string; child?: ChildProcess; url?: string }> = [
      { mode: 'client -> P, D (no proxy)' },
    ];
    for (const [mode, p, d] of [
      ['proxy, HTTP to workers', pre.ready.url, dec.ready.url],
      ['proxy, ZeroMQ to workers', pre.ready.zmq, dec.ready.zmq],
    ] as const) {
      const transport = mode.includes('ZeroMQ') ? 'zmq' : 'http';
      const px = await spawnReady(
        [cli, 'proxy', '--port', '0', '--transport', transport, '--prefill', String(p), '--decode', String(d)],
        env,
      );
      children.push(px.child);
      proxies.push({ mode, child: px.child, url: String(px.ready.url) });
    }
    const ask = (m: (typeof proxies)[number]) =>
      m.url ? proxyAsk(agent, m.url) : directAsk(agent, String(pre.ready.url), String(dec.ready.url));
    // V8 optimises the proxy over its first thousand requests or so: each mode warms up before the rounds.
    for (const m of proxies) await runLoad(1000, concurrency, `warm ${m.mode}`, ask(m));
    const per = new Map<string, Array<{ r: LoadResult; rps: number; p99: number; cpu?: number }>>(
      proxies.map((m) => [m.mode, []]),
    );
    const loads: number[] = [];
    for (let round = 0; round < rounds; round++) {
      // Alternate the order too: no mode always runs first after a pause.
      const order = round % 2 ? [...proxies].reverse() : proxies;
      for (const m of order) {
        const c0 = cpuMicros(m.child?.pid);
        const r = await runLoad(requests, concurrency, `round ${round} ${m.mode}`, ask(m));
        const c1 = cpuMicros(m.child?.pid);
        per.get(m.mode)!.push({
          r,
          rps: r.latencies.length / r.seconds,
          p99: percentile(r.latencies, 99),
          cpu: c0 !== undefined && c1 !== undefined ? (c1 - c0) / r.latencies.length : undefined,
        });
      }
      loads.push(os.loadavg()[0]);
    }
    const base = per.get(proxies[0].mode)!;
    const reasons: string[] = [];
    const rows = proxies.map((m): ProxyRow => {
      const xs = per.get(m.mode)!;
      const rps = xs.map((x) => x.rps);
      const all = xs.flatMap((x) => x.r.latencies);
      for (const x of xs) reasons.push(...x.r.reasons);
      const cpu = xs.map((x) => x.cpu).filter((c): c is number => c !== undefined);
      return {
        mode: m.mode,
        requestsPerSecond: median(rps),
        min: Math.min(...rps),
        max: Math.max(...rps),
        p50Ms: median(xs.map((x) => percentile(x.r.latencies, 50))),
        p99Ms: median(xs.map((x) => x.p99)),
        cpuUsPerRequest: m.child && cpu.length ? median(cpu) : undefined,
        ratio: median(xs.map((x, i) => x.rps / base[i].rps)),
        p99Ratio: median(xs.map((x, i) => x.p99 / base[i].p99)),
        checked: all.length,
        wrong: xs.reduce((s, x) => s + x.r.wrong, 0),
      };
    });
    return {
      rows,
      requests,
      concurrency,
      rounds,
      loadAverage: loads,
      ...(reasons.length ? { reasons: reasons.slice(0, 5) } : {}),
    };
  } finally {
    agent.destroy();
    for (const c of children) c.kill('SIGTERM');
  }
}
