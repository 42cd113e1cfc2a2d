// The demo's account of where the time went: per round (the first reads
// every prefill page for the first time; later rounds read them again, as a
// KV cache in service does), per request, per descriptor and per rank.
import type { RoundReport } from './decode-worker';

export const median = (xs: number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length === 0 ? Number.NaN : s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
};
const fmtMiB = (b: number) => `${(b / 2 ** 20).toFixed(1)} MiB`;

/** One round over every rank: wall time from the first start to the last end, and its medians. */
export interface RoundSummary {
  round: number;
  wallMs: number;
  bytes: number;
  gbps: number;
  requestMs: number;
  requestMaxMs: number;
  postMs: number;
  transferMs: number;
  usPerDescriptor: number;
  /** CPU time of every decode rank over the round, as cores kept busy (CPU ms / wall ms). */
  cores: number;
  /** Bytes per CPU second of the decode ranks (GB/s of CPU time): the copy's cost, whatever else ran. */
  gbPerCpuS: number;
  /** Share of that CPU time spent on the JS threads (making, posting and completing requests). */
  jsShare: number;
  /** Share of that CPU time spent in the kernel (NIXL on one host: UCX's cma copies with process_vm_readv). */
  sysShare: number;
  verifyMs: number;
}

export function summarizeRound(ranks: RoundReport[]): RoundSummary {
  const wallMs = Math.max(...ranks.map((r) => r.end)) - Math.min(...ranks.map((r) => r.start));
  const bytes = ranks.reduce((a, r) => a + r.bytes, 0);
  const requestMs = ranks.flatMap((r) => r.requestMs);
  const cpuMs = ranks.reduce((a, r) => a + r.cpuMs, 0);
  return {
    round: ranks[0].round,
    wallMs,
    bytes,
    gbps: bytes / (wallMs * 1e6),
    requestMs: median(requestMs),
    requestMaxMs: Math.max(...requestMs),
    postMs: median(ranks.flatMap((r) => r.postMs)),
    transferMs: median(ranks.flatMap((r) => r.transferMs)),
    // A rank's wall time over its descriptors: what one descriptor costs it, all in.
    usPerDescriptor: median(ranks.map((r) => ((r.end - r.start) * 1000) / r.descriptors)),
    cores: cpuMs / wallMs,
    gbPerCpuS: bytes / (cpuMs * 1e6),
    jsShare: ranks.reduce((a, r) => a + r.jsCpuMs, 0) / cpuMs,
    sysShare: ranks.reduce((a, r) => a + r.sysCpuMs, 0) / cpuMs,
    verifyMs: Math.max(...ranks.map((r) => r.verifyMs)),
  };
}

export function printBreakdown(
  byRank: RoundReport[][],
  o: { handshakeMs: number[]; remoteRanks(rank: number): number[]; memcpyGbps: number },
): RoundSummary[] {
  const rounds = byRank[0].map((_, k) => summarizeRound(byRank.map((r) => r[k])));
  console.log(
    `\n  where the time went (all decode ranks pulling at once; memcpy of this run ${o.memcpyGbps.toFixed(2)} GB/s, one thread):`,
  );
  const head = [
    'round',
    'wall ms',
    'GB/s',
    'x memcpy',
    'request ms',
    'max',
    'post ms',
    'transfer ms',
    'us/desc',
    'cores',
    'GB/cpu-s',
    'js',
    'kernel',
    'verify ms',
  ];
  const cells = rounds.map((r) => [
    r.round === 0 ? '1 (first)' : String(r.round + 1),
    r.wallMs.toFixed(0),
    r.gbps.toFixed(2),
    (r.gbps / o.memcpyGbps).toFixed(2),
    r.requestMs.toFixed(1),
    r.requestMaxMs.toFixed(1),
    r.postMs.toFixed(2),
    r.transferMs.toFixed(1),
    r.usPerDescriptor.toFixed(2),
    r.cores.toFixed(2),
    r.gbPerCpuS.toFixed(2),
    Number.isNaN(r.jsShare) ? '-' : `${(100 * r.jsShare).toFixed(0)}%`,
    `${(100 * r.sysShare).toFixed(0)}%`,
    r.verifyMs.toFixed(0),
  ]);
  const w = head.map((h, i) => Math.max(h.length, ...cells.map((c) => c[i].length)));
  for (const row of [head, ...cells]) console.log(`    ${row.map((c, i) => c.padStart(w[i])).join('  ')}`);
  console.log(
    '    request: pullBlocks() to its result (queued behind --in-flight pulls included); post: making and posting its READs;',
  );
  console.log(
    "    transfer: post to completion; us/desc: a rank's wall time over its descriptors; verify: not in wall time;",
  );
  console.log(
    '    cores: CPU time of all decode ranks over the wall time; GB/cpu-s: bytes per second of that CPU time; js: its share on JS threads;',
  );
  console.log(
    "    kernel: its share in the kernel (system calls: NIXL's UCX copies with process_vm_readv on one host, the loopback engine with memcpy)",
  );
  const first = rounds[0];
  const later = rounds.slice(1);
  const warm = later.map((r) => r.gbps);
  console.log('');
  if (later.length) {
    console.log(
      `  throughput  ${median(warm).toFixed(2)} GB/s in rounds 2-${rounds.length} (median; ${Math.min(...warm).toFixed(2)}-${Math.max(...warm).toFixed(2)}), all decode ranks together`,
    );
    console.log(
      `              ${first.gbps.toFixed(2)} GB/s in round 1: each rank's first touch of the prefill's pages (see docs/benchmarks.md, the demo)`,
    );
  } else {
    console.log(`  throughput  ${first.gbps.toFixed(2)} GB/s (one round: the first touch of the prefill's pages)`);
  }
  for (const [i, rs] of byRank.entries()) {
    const laterMs = rs.slice(1).map((r) => r.end - r.start);
    console.log(
      `    decode rank ${i}: reads prefill rank(s) ${o.remoteRanks(i).join(',')}, ${fmtMiB(rs[0].bytes)} per round in ${(rs[0].end - rs[0].start).toFixed(0)} ms (first)${laterMs.length ? `, ${median(laterMs).toFixed(0)} ms (later, median)` : ''}, handshake ${o.handshakeMs[i].toFixed(1)} ms`,
    );
  }
  return rounds;
}
