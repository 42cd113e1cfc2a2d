// A real etcd (Debian's etcd-server) for the fleet tests: loopback ports that
// were free a moment ago, a temporary data directory, killed after. Tests
// skip, saying why, only when no etcd binary is installed (CI installs it,
// and fails them instead).
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';

function findEtcd(): string | undefined {
  for (const p of [process.env.ETCD_BIN, '/usr/bin/etcd', '/usr/local/bin/etcd']) {
    if (!p) continue;
    try {
      execFileSync(p, ['--version'], { stdio: 'ignore' });
      return p;
    } catch {}
  }
  return undefined;
}

/** The etcd binary, when installed. */
export const ETCD_BIN = findEtcd();
/** Why the etcd tests skip, or '' when they run (always, under NIXL_NODE_REQUIRE_ETCD=1: CI installs etcd). */
export const ETCD_MISSING =
  ETCD_BIN || process.env.NIXL_NODE_REQUIRE_ETCD === '1'
    ? ''
    : ' (SKIPPED: no etcd binary; apt-get install etcd-server, or set ETCD_BIN)';

async function freePort(): Promise<number> {
  const s = net.createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const port = (s.address() as net.AddressInfo).port;
  await new Promise((r) => s.close(r));
  return port;
}

/** One etcd member on loopback; stop() and start() again keep its data and ports (a restart). */
export class EtcdServer {
  url = '';
  #proc?: ChildProcess;
  #dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-etcd-'));
  #client = 0;
  #peer = 0;

  async start(): Promise<this> {
    if (!ETCD_BIN) throw new Error('etcd is not installed');
    if (this.#client === 0) {
      this.#client = await freePort();
      this.#peer = await freePort();
    }
    this.url = `http://127.0.0.1:${this.#client}`;
    const peer = `http://127.0.0.1:${this.#peer}`;
    const p = spawn(
      ETCD_BIN,
      [
        '--name',
        'fleet-test',
        '--data-dir',
        this.#dir,
        '--listen-client-urls',
        this.url,
        '--advertise-client-urls',
        this.url,
        '--listen-peer-urls',
        peer,
        '--initial-advertise-peer-urls',
        peer,
        '--initial-cluster',
        `fleet-test=${peer}`,
        '--log-level',
        'error',
      ],
      { stdio: ['ignore', 'ignore', 'pipe'] },
    );
    let err = '';
    p.stderr?.on('data', (d) => {
      err = (err + d).slice(-4000);
    });
    this.#proc = p;
    const until = Date.now() + 15_000;
    for (;;) {
      if (p.exitCode !== null) throw new Error(`etcd exited ${p.exitCode}: ${err}`);
      try {
        const r = await fetch(`${this.url}/health`);
        if (r.ok && ((await r.json()) as { health?: string }).health === 'true') return this;
      } catch {}
      if (Date.now() > until) throw new Error(`etcd did not come up: ${err}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /** Kills it (SIGKILL: a crash, nothing said to clients). */
  async stop(): Promise<void> {
    const p = this.#proc;
    if (!p || p.exitCode !== null || p.signalCode !== null) return;
    const exited = new Promise((r) => p.once('exit', r));
    p.kill('SIGKILL');
    await exited;
  }

  async destroy(): Promise<void> {
    await this.stop();
    fs.rmSync(this.#dir, { recursive: true, force: true });
  }
}
