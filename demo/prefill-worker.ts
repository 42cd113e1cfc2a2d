// Demo prefill engine: all its TP ranks in this process, KV caches filled
// with the verifiable pattern, one handshake side channel, and a tracker per
// rank that reports when decode has read each request's blocks.
import { DescList, NixlAgent, PrefillTracker, allocate, servePrefill, type KvLayout } from '../lib';
import type { HandshakeMethod } from '../lib/handshake';
import { fillRank, rankBytes, rankLayout, type KvSpec } from './kvpattern';

export interface PrefillConfig {
  spec: Omit<KvSpec, 'tpRank'>;
  method: HandshakeMethod;
  engine?: 'loopback' | 'nixl';
  progressThread?: boolean;
  compatibilityHash: string;
}

async function main(): Promise<void> {
  const cfg = JSON.parse(process.argv[2]) as PrefillConfig;
  const t0 = performance.now();
  const ranks: Array<{ agent: NixlAgent; layout: KvLayout }> = [];
  const trackers: PrefillTracker[] = [];
  for (let r = 0; r < cfg.spec.tpSize; r++) {
    const spec = { ...cfg.spec, tpRank: r };
    const agent = new NixlAgent(`demo-prefill-tp${r}-${process.pid}`, {
      engine: cfg.engine,
      progressThread: cfg.progressThread,
    });
    const mem = allocate(rankBytes(spec));
    fillRank(mem, spec);
    agent.registerMemory(mem);
    ranks.push({ agent, layout: rankLayout(spec, 'demo-prefill', DescList.from(mem).addr(0)) });
    trackers.push(new PrefillTracker({ agent, tpSize: cfg.spec.tpSize, expireMs: 120_000 }));
  }
  const server = await servePrefill({
    ranks,
    compatibilityHash: cfg.compatibilityHash,
    port: 0,
    handshake: cfg.method,
  });
  let closing = false;
  const shutdown = async () => {
    if (closing) return;
    closing = true;
    await server.close();
    for (const t of trackers) await t.close();
    for (const r of ranks) r.agent.close();
    process.exit(0);
  };
  process.send!({
    type: 'ready',
    port: server.basePort,
    fillMs: performance.now() - t0,
    engine: ranks[0].agent.engine,
  });
  process.on('message', async (m: { type: string; requestId?: string; blockIds?: number[] }) => {
    if (m.type === 'expect') {
      const released = await Promise.all(trackers.map((t) => t.expect(m.requestId!, m.blockIds!)));
      // The demo may have ended (a failed decode rank) while this waited.
      if (process.connected)
        process.send!({ type: 'released', requestId: m.requestId, reasons: released.map((x) => x.reason) });
    } else if (m.type === 'exit') await shutdown();
  });
  // The demo went away without saying exit (it failed, or was killed).
  process.once('disconnect', shutdown);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
