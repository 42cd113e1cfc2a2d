// Demo decode rank: handshake with the prefill ranks it reads from, pull its
// requests a few at a time, check every byte of its slice, report progress.
import { DescList, KvPuller, NixlAgent, allocate } from '../lib';
import type { HandshakeMethod } from '../lib/handshake';
import { rankBytes, rankLayout, verifyRank, type KvSpec } from './kvpattern';

export interface DecodeConfig {
  spec: KvSpec;
  prefillTp: number;
  port: number;
  method: HandshakeMethod;
  engine?: 'loopback' | 'nixl';
  progressThread?: boolean;
  compatibilityHash: string;
  requests: Array<{ requestId: string; local: number[]; remote: number[] }>;
  inFlight: number;
}

async function main(): Promise<void> {
  const cfg = JSON.parse(process.argv[2]) as DecodeConfig;
  const agent = new NixlAgent(`demo-decode-tp${cfg.spec.tpRank}-${process.pid}`, {
    engine: cfg.engine,
    progressThread: cfg.progressThread,
  });
  const mem = allocate(rankBytes(cfg.spec));
  mem.fill(0); // a KV cache in service has its pages in place; fault them in before timing
  agent.registerMemory(mem);
  const layout = rankLayout(cfg.spec, 'demo-decode', DescList.from(mem).addr(0));
  const puller = new KvPuller({
    agent,
    layout,
    handshake: cfg.method,
    expectedHash: cfg.compatibilityHash,
    maxConcurrent: cfg.inFlight,
  });
  const remote = { host: '127.0.0.1', port: cfg.port, tpSize: cfg.prefillTp };
  const handshakeMs = await puller.handshakeMs(remote);
  // All decode ranks start pulling together, so the wall time measures the pulls.
  process.send!({ type: 'ready' });
  await new Promise<void>((resolve) => process.once('message', () => resolve()));
  const start = performance.timeOrigin + performance.now();
  let bad = 0;
  let bytes = 0;
  let descriptors = 0;
  await Promise.all(
    cfg.requests.map(async (q) => {
      const r = await puller.pullBlocks({
        remote,
        localBlockIds: q.local,
        remoteBlockIds: q.remote,
        requestId: q.requestId,
        timeoutMs: 60_000,
      });
      bytes += r.bytes;
      descriptors += r.descriptors;
      process.send!({ type: 'progress', bytes: r.bytes });
    }),
  );
  const end = performance.timeOrigin + performance.now();
  // Verify after all pulls: every byte of every block this rank received.
  for (const q of cfg.requests) bad += verifyRank(mem, cfg.spec, q.local, q.remote);
  const stats = puller.stats.snapshot();
  await puller.close();
  agent.close();
  process.send!({ type: 'done', handshakeMs, start, end, bytes, descriptors, bad, stats, remoteRanks: [] });
}

main().catch((e) => {
  process.send!({ type: 'error', message: String(e?.stack ?? e) });
  process.exit(1);
});
