// Small timing helpers shared by the benchmarks.
export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

export function percentile(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}

export function nowNs(): bigint {
  return process.hrtime.bigint();
}

export function fmtBytes(n: number): string {
  if (n >= 1 << 20) return `${n / (1 << 20)} MiB`;
  if (n >= 1 << 10) return `${n / (1 << 10)} KiB`;
  return `${n} B`;
}
