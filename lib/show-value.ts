// A value from the wire, shown in an error message. Decoded msgpack holds
// bigints (JSON.stringify throws on them) and null-prototype maps (String()
// throws on them): the message must never be the thing that fails.

import { Float64 } from './handshake/msgpack';

/** A short, printable rendering of any value; never throws. */
export function showValue(v: unknown, max = 80): string {
  let s: string;
  try {
    s = render(v, 0);
  } catch {
    s = Object.prototype.toString.call(v);
  }
  return s.length > max ? `${s.slice(0, max - 3)}...` : s;
}

function render(v: unknown, depth: number): string {
  if (typeof v === 'bigint') return `${v}n`;
  if (typeof v === 'string') return JSON.stringify(v.length > 200 ? v.slice(0, 200) : v);
  if (typeof v !== 'object' || v === null) return String(v);
  if (v instanceof Uint8Array) {
    const text = Buffer.from(v.buffer, v.byteOffset, v.byteLength).toString('latin1');
    return v.length <= 64 && /^[\x20-\x7e]*$/.test(text) ? `bin ${JSON.stringify(text)}` : `bin(${v.length} bytes)`;
  }
  if (depth >= 3) return Array.isArray(v) ? '[...]' : '{...}';
  if (Array.isArray(v))
    return `[${v
      .slice(0, 8)
      .map((x) => render(x, depth + 1))
      .join(', ')}${v.length > 8 ? ', ...' : ''}]`;
  if (v instanceof Map) return `Map(${v.size})`;
  if (v instanceof Float64) return `${v.value} (float)`;
  const keys = Object.keys(v);
  return `{${keys
    .slice(0, 8)
    .map((k) => `${JSON.stringify(k)}: ${render((v as Record<string, unknown>)[k], depth + 1)}`)
    .join(', ')}${keys.length > 8 ? ', ...' : ''}}`;
}
