// A prefill that dies, restarts or was misconfigured: the decode side's
// KvPuller must fail the pulls it cannot serve, promptly, and work again on
// the next pull once a good prefill answers on the same port (issue 9).
import { afterEach, expect, it } from 'vitest';
import { DescList, KvPuller, NixlAgent, PullError } from '../../lib';
import * as kv from '../../demo/kvpattern';
import { Peer, freePort } from '../helpers';

const spec = { heads: 8, headBytes: 1024, numBlocks: 64, regions: 8, method: 'zmq' as const };
const prefills: Peer[] = [];
const closers: Array<() => Promise<void> | void> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
  for (const p of prefills.splice(0)) if (p.proc.exitCode === null && p.proc.signalCode === null) p.kill();
});

async function startPrefill(port: number, extra: Record<string, unknown> = {}): Promise<Peer> {
  const peer = new Peer('prefill-kv.js', [
    JSON.stringify({ ...spec, tpSize: 1, port, agentName: 'prefill-fixed', ...extra }),
  ]);
  prefills.push(peer);
  await peer.next();
  return peer;
}

function decode() {
  const s = { ...spec, tpSize: 1, tpRank: 0 };
  // Each transfer waits 20 ms in the worker, so a kill lands while every pull is in flight.
  const agent = new NixlAgent('decode-restart', { engine: 'loopback', testDelayUs: 20_000 });
  const mem = Buffer.alloc(kv.rankBytes(s));
  agent.registerMemory(mem);
  const puller = new KvPuller({
    agent,
    layout: kv.rankLayout(s, 'decode', DescList.from(mem).addr(0)),
    handshake: 'zmq',
    expectedHash: 'kvhash',
    handshakeTimeoutMs: 1000,
  });
  closers.push(
    () => agent.close(),
    () => puller.close(),
  );
  let n = 0;
  const pull = async (port: number) => {
    const local = [n % 32, (n % 32) + 32];
    const remote = [(n * 7) % 64, (n * 7 + 3) % 64];
    n++;
    await puller.pullBlocks({
      remote: { host: '127.0.0.1', port, tpSize: 1 },
      localBlockIds: local,
      remoteBlockIds: remote,
      requestId: `r${n}`,
      timeoutMs: 5000,
    });
    return kv.verifyRank(mem, s, local, remote);
  };
  return { puller, pull };
}

it('a prefill that advertised a wrong address, corrected and restarted on the same port, serves the next pull', async () => {
  const port = await freePort();
  const bad = await startPrefill(port, { lieAddr: true });
  const { puller, pull } = decode();
  const err = await pull(port).catch((e: PullError) => e);
  expect(err, String(err)).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_NOT_FOUND' });
  expect(puller.resources().engines).toBe(0);
  bad.kill();
  await bad.exit();
  await startPrefill(port);
  expect(await pull(port)).toBe(0); // every byte right
});

it('a prefill SIGKILLed mid-pull and restarted on the same port: failures are prompt, the next pulls work', async () => {
  const port = await freePort();
  const first = await startPrefill(port);
  const { puller, pull } = decode();
  expect(await pull(port)).toBe(0);
  let stop = false;
  const failures: Array<{ ms: number; kind: string; message: string }> = [];
  let okAfterRestart = 0;
  let restarted = false;
  const worker = async () => {
    while (!stop) {
      const t0 = performance.now();
      try {
        expect(await pull(port)).toBe(0);
        if (restarted) okAfterRestart++;
      } catch (e) {
        expect(e).toBeInstanceOf(PullError);
        failures.push({ ms: performance.now() - t0, kind: (e as PullError).kind, message: (e as Error).message });
        await new Promise((r) => setTimeout(r, 5));
      }
      if (okAfterRestart >= 20) stop = true;
    }
  };
  const workers = Array.from({ length: 6 }, worker);
  await new Promise((r) => setTimeout(r, 150));
  first.kill();
  await first.exit();
  await startPrefill(port);
  restarted = true;
  const deadline = setTimeout(() => {
    stop = true;
  }, 15_000);
  await Promise.all(workers);
  clearTimeout(deadline);
  expect(okAfterRestart, JSON.stringify(failures.slice(-3))).toBeGreaterThanOrEqual(20);
  expect(failures.filter((f) => /already loaded/.test(f.message))).toEqual([]);
  // Each failure surfaced within the handshake timeout (1 s) plus slack, not behind another handshake.
  for (const f of failures) expect(f.ms, f.message).toBeLessThan(2500);
  expect(puller.resources()).toMatchObject({ xferHandles: 0, activePulls: 0, engines: 1 });
}, 40_000);
