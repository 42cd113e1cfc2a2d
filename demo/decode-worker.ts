// Demo decode rank: handshake with the prefill ranks it reads from, then one
// round of pulls per 'go' (a few at a time), every byte of its slice checked
// after each round, and where the time went reported per round.
import { readFileSync } from 'node:fs';
import { DescList, KvPuller, NixlAgent, allocate } from '../lib';
import type { HandshakeMethod } from '../lib/handshake';
import { rankBytes, rankLayout, verifyRank, type KvSpec } from './kvpattern';

export interface DemoRequest {
  requestId: string;
  local: number[];
  remote: number[];
}

export interface DecodeConfig {
  spec: KvSpec;
  prefillTp: number;
  port: number;
  method: HandshakeMethod;
  engine?: 'loopback' | 'nixl';
  progressThread?: boolean;
  compatibilityHash: string;
  /** Requests per round: round 0 reads the prefill's pages for the first time, later rounds read them again. */
  rounds: DemoRequest[][];
  inFlight: number;
}

/** One round of one decode rank: its wall time, and per request where the time went (ms). */
export interface RoundReport {
  type: 'round';
  round: number;
  start: number;
  end: number;
  bytes: number;
  descriptors: number;
  /** Per request: from pullBlocks() to its result, the post (make + post every READ), post to completion. */
  requestMs: number[];
  postMs: number[];
  transferMs: number[];
  /** CPU time of this process (every thread: JS, the engine's copying thread) from start to end. */
  cpuMs: number;
  /** The part of cpuMs spent in the kernel (system calls: process_vm_readv copies, page faults, futexes). */
  sysCpuMs: number;
  /** CPU time of the JS thread alone from start to end (Linux; NaN elsewhere). */
  jsCpuMs: number;
  /** Checking every byte of the round, after its pulls (not in start..end). */
  verifyMs: number;
  bad: number;
}

async function main(): Promise<void> {
  const cfg = JSON.parse(process.argv[2]) as DecodeConfig;
  const agent = new NixlAgent(`demo-decode-tp${cfg.spec.tpRank}-${process.pid}`, {
    engine: cfg.engine,
    progressThread: cfg.progressThread,
  });
  const mem = allocate(rankBytes(cfg.spec));
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
  for (const [round, requests] of cfg.rounds.entries()) {
    // A KV cache in service has its pages in place: fault them in (and clear
    // what the last round wrote, so this round's check sees only its own bytes).
    mem.fill(0);
    // All decode ranks start a round together, so its wall time measures the pulls.
    process.send!({ type: 'ready', round, handshakeMs });
    await new Promise<void>((resolve) => process.once('message', () => resolve()));
    process.send!(await pullRound(puller, remote, requests, round, mem, cfg.spec));
  }
  const stats = puller.stats.snapshot();
  await puller.close();
  agent.close();
  process.send!({ type: 'done', handshakeMs, stats });
}

async function pullRound(
  puller: KvPuller,
  remote: { host: string; port: number; tpSize: number },
  requests: DemoRequest[],
  round: number,
  mem: Buffer,
  spec: KvSpec,
): Promise<RoundReport> {
  const now = () => performance.timeOrigin + performance.now();
  const r: RoundReport = {
    type: 'round',
    round,
    start: now(),
    end: 0,
    bytes: 0,
    descriptors: 0,
    requestMs: [],
    postMs: [],
    transferMs: [],
    cpuMs: 0,
    sysCpuMs: 0,
    jsCpuMs: 0,
    verifyMs: 0,
    bad: 0,
  };
  const cpu0 = process.cpuUsage();
  const js0 = threadCpuNs();
  await Promise.all(
    requests.map(async (q) => {
      const t0 = performance.now();
      const res = await puller.pullBlocks({
        remote,
        localBlockIds: q.local,
        remoteBlockIds: q.remote,
        requestId: q.requestId,
        timeoutMs: 60_000,
      });
      r.requestMs.push(performance.now() - t0);
      r.postMs.push(res.postMs);
      r.transferMs.push(res.transferMs);
      r.bytes += res.bytes;
      r.descriptors += res.descriptors;
      process.send!({ type: 'progress', bytes: res.bytes });
    }),
  );
  r.end = now();
  const cpu = process.cpuUsage(cpu0);
  r.cpuMs = (cpu.user + cpu.system) / 1000;
  r.sysCpuMs = cpu.system / 1000;
  r.jsCpuMs = (threadCpuNs() - js0) / 1e6;
  // Verify after all pulls: every byte of every block this rank received.
  const v0 = performance.now();
  for (const q of requests) r.bad += verifyRank(mem, spec, q.local, q.remote);
  r.verifyMs = performance.now() - v0;
  return r;
}

/** Time this thread (the JS thread) has run on a CPU, ns: the first field of Linux's schedstat; NaN elsewhere. */
function threadCpuNs(): number {
  try {
    return Number(readFileSync('/proc/thread-self/schedstat', 'utf8').split(' ')[0]);
  } catch {
    return Number.NaN;
  }
}

main().catch((e) => {
  process.send!({ type: 'error', message: String(e?.stack ?? e) });
  process.exit(1);
});
