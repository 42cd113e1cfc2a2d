// One stalled prefill cannot starve pulls from the others: KvPuller's slots,
// timeouts and notification waits are per remote engine, and a connection to
// another prefill never waits for the stalled one's pulls to end. Found by
// attack: with 100 pulls queued to a SIGSTOPped prefill, a pull from a
// healthy one was still pending after 30 s (all slots waited on the stopped
// peer's notifications); later, a healthy prefill's first pull waited 2.9 s
// behind them when both had the same engine id (it was taken for a restart
// of the stopped one, whose pulls had to end first).
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, KvPuller, NixlAgent, type PullError } from '../../lib';
import * as kv from '../../demo/kvpattern';
import { Peer } from '../helpers';

const spec = { heads: 8, headBytes: 1024, numBlocks: 64, regions: 4, method: 'zmq' as const, tpSize: 1 };
const peers: Peer[] = [];
const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
  for (const p of peers.splice(0)) {
    p.proc.kill('SIGCONT');
    p.kill();
  }
});

async function prefill(name: string, engineId: string): Promise<{ peer: Peer; port: number }> {
  const peer = new Peer('prefill-kv.js', [JSON.stringify({ ...spec, agentName: name, engineId })]);
  peers.push(peer);
  const { port } = await peer.next<{ port: number }>();
  return { peer, port };
}

describe.each([
  // Its side channel stopped too: those pulls wait in their handshakes.
  ['another engine, the stopped one never connected', 'hol-other', false],
  // Taken for a new incarnation of the stopped one (another agent name): it
  // must not wait for the old one's pulls to end.
  ['the same engine id, the stopped one connected', 'prefill', true],
])(
  'pulls queued to a SIGSTOPped prefill do not delay a pull from a healthy one: %s',
  (_what, healthyEngine, stoppedWarm) => {
    it.each([
      ['connected before', true],
      ['at its first pull, handshake included', false],
    ])(
      'the healthy prefill %s',
      async (_when, warm) => {
        const stopped = await prefill('hol-stopped', 'prefill');
        const healthy = await prefill('hol-healthy', healthyEngine);
        const agent = new NixlAgent('hol-decode', { engine: 'loopback' });
        const mem = Buffer.alloc(kv.rankBytes({ ...spec, tpRank: 0 }));
        agent.registerMemory(mem);
        const puller = new KvPuller({
          agent,
          layout: kv.rankLayout({ ...spec, tpRank: 0 }, 'decode', DescList.from(mem).addr(0)),
          handshake: 'zmq',
          expectedHash: 'kvhash',
          handshakeTimeoutMs: 2000,
          maxConcurrent: 4,
        });
        closers.push(
          () => agent.close(),
          () => puller.close(),
        );
        const pull = (port: number, i: number, timeoutMs: number) =>
          puller.pullBlocks({
            remote: { host: '127.0.0.1', port, tpSize: 1 },
            localBlockIds: [i % 64],
            remoteBlockIds: [(i * 7) % 64],
            requestId: `r${port}-${i}`,
            timeoutMs,
          });
        if (stoppedWarm) await pull(stopped.port, 0, 5000);
        if (warm) await pull(healthy.port, 0, 5000);

        stopped.peer.proc.kill('SIGSTOP');
        // Enough pulls to fill every slot many times over; each waits for a
        // notification the stopped peer never takes.
        let settledWhileStopped = 0;
        let resumed = false;
        const stuck = Array.from({ length: 100 }, (_, i) =>
          pull(stopped.port, i + 1, 3000)
            .then(
              () => 'ok',
              (e: PullError) => e.kind,
            )
            .finally(() => {
              if (!resumed) settledWhileStopped++;
            }),
        );
        await new Promise((r) => setTimeout(r, 100));
        const t0 = performance.now();
        const r = await pull(healthy.port, 1, 5000);
        const ms = performance.now() - t0;
        console.log(`healthy pull behind 100 stalled (${_what}, ${_when}): ${ms.toFixed(1)} ms`);
        expect(r.bytes).toBeGreaterThan(0);
        expect(kv.verifyRank(mem, { ...spec, tpRank: 0 }, [1], [7])).toBe(0);
        // Not behind the stalled engine's queue (25 rounds of up to 3 s there).
        expect(ms).toBeLessThan(1500);
        // The stopped peer really held them: none finished while it was
        // stopped (under the same engine id the healthy one replaced it, and
        // the pulls in flight on it end as they may).
        if (healthyEngine !== 'prefill') expect(settledWhileStopped).toBe(0);
        resumed = true;
        stopped.peer.proc.kill('SIGCONT');
        const kinds = await Promise.all(stuck);
        // Under the same engine id the healthy prefill replaced the stopped one:
        // the pulls still queued for it connect again, and find it stopped.
        expect(kinds.every((k) => k === 'ok' || k === 'timeout' || k === 'handshake')).toBe(true);
        expect(puller.resources()).toMatchObject({ activePulls: 0, xferHandles: 0 });
      },
      120_000,
    );
  },
);
