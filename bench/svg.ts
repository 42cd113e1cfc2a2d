// A dependency-free horizontal bar chart of benchmark ratios.
export interface Bar {
  label: string;
  value: number;
  /** Fill; default blue. Bars of one series (a configuration) share a colour. */
  color?: string;
}

export interface Panel {
  title: string;
  bars: Bar[];
  /** A reference line, e.g. 1.0 = the baseline. */
  reference?: number;
}

function esc(s: string): string {
  return s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
}

/** title: one line; subtitle (the machine): a smaller second line, so both fit the width. */
export function barChart(title: string, panels: Panel[], subtitle = ''): string {
  const W = 760;
  const labelW = 260;
  const barH = 16;
  const gap = 6;
  let y = subtitle ? 58 : 40;
  const parts: string[] = [];
  for (const p of panels) {
    const max = Math.max(p.reference ?? 0, ...p.bars.map((b) => b.value)) * 1.1 || 1;
    const scale = (W - labelW - 70) / max;
    parts.push(`<text x="10" y="${y}" font-weight="bold">${esc(p.title)}</text>`);
    y += 10;
    const top = y;
    for (const b of p.bars) {
      const w = Math.max(1, b.value * scale);
      parts.push(`<text x="10" y="${y + barH - 4}">${esc(b.label)}</text>`);
      parts.push(
        `<rect x="${labelW}" y="${y}" width="${w.toFixed(1)}" height="${barH}" fill="${b.color ?? '#4c78a8'}"/>`,
      );
      parts.push(`<text x="${labelW + w + 4}" y="${y + barH - 4}">${b.value.toFixed(2)}</text>`);
      y += barH + gap;
    }
    if (p.reference !== undefined) {
      const x = labelW + p.reference * scale;
      parts.push(
        `<line x1="${x.toFixed(1)}" y1="${top - 4}" x2="${x.toFixed(1)}" y2="${y}" stroke="#e45756" stroke-dasharray="4 3"/>`,
      );
    }
    y += 24;
  }
  return (
    `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${y}" font-family="sans-serif" font-size="12">` +
    `<rect width="100%" height="100%" fill="white"/><text x="10" y="20" font-size="14" font-weight="bold">${esc(title)}</text>` +
    (subtitle ? `<text x="10" y="38" font-size="11" fill="#555">${esc(subtitle)}</text>` : '') +
    `${parts.join('')}</svg>\n`
  );
}
