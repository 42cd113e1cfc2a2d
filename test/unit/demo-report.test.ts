// The demo's account of where the time went: a round over every decode rank,
// its wall time, and how its CPU time splits (demo/report.ts).
import { expect, it } from 'vitest';
import type { RoundReport } from '../../demo/decode-worker';
import { summarizeRound } from '../../demo/report';

const rank = (over: Partial<RoundReport>): RoundReport => ({
  type: 'round',
  round: 1,
  start: 1000,
  end: 1100,
  bytes: 2 ** 28,
  descriptors: 16384,
  requestMs: [10, 20],
  postMs: [0.2, 0.3],
  transferMs: [5, 6],
  cpuMs: 80,
  sysCpuMs: 30,
  jsCpuMs: 20,
  verifyMs: 50,
  bad: 0,
  ...over,
});

it('a round: wall time from the first start to the last end, CPU as cores kept busy, bytes per CPU second, the JS and kernel shares', () => {
  const s = summarizeRound([rank({}), rank({ start: 1010, end: 1200, cpuMs: 120, sysCpuMs: 90, jsCpuMs: 40 })]);
  expect(s.wallMs).toBe(200);
  expect(s.gbps).toBeCloseTo(2 ** 29 / 200e6, 6);
  expect(s.cores).toBeCloseTo(200 / 200, 6);
  expect(s.gbPerCpuS).toBeCloseTo(2 ** 29 / 200e6, 6);
  expect(s.jsShare).toBeCloseTo(60 / 200, 6);
  expect(s.sysShare).toBeCloseTo(120 / 200, 6);
  expect(s.requestMaxMs).toBe(20);
  expect(s.verifyMs).toBe(50);
});

it('a platform without per-thread CPU time gives no JS share, not a wrong one', () => {
  const s = summarizeRound([rank({ jsCpuMs: Number.NaN })]);
  expect(s.jsShare).toBeNaN();
  expect(s.cores).toBeCloseTo(0.8, 6);
});
