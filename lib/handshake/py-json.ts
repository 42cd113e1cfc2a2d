// Python's json.dumps, byte for byte, for vLLM's compatibility hash.
import { createHash } from 'node:crypto';

// ---- compatibility hash -----------------------------------------------------

/** A factor of vLLM's compatibility hash (JSON-like). */
export type HashFactor = string | number | boolean | null | HashFactor[] | { [k: string]: HashFactor };

/** Python's json.dumps(v, sort_keys=True): ', ' and ': ' separators, ASCII-only escapes. */
export function pyJsonDumps(v: HashFactor): string {
  if (v === null) return 'null';
  if (v === true) return 'true';
  if (v === false) return 'false';
  if (typeof v === 'number') return pyNumber(v);
  if (typeof v === 'string') return pyString(v);
  if (Array.isArray(v)) return `[${v.map(pyJsonDumps).join(', ')}]`;
  const keys = Object.keys(v).sort(pyCompare);
  return `{${keys.map((k) => `${pyString(k)}: ${pyJsonDumps(v[k])}`).join(', ')}}`;
}

// Python sorts str by code point; JS sort() by UTF-16 unit.
function pyCompare(a: string, b: string): number {
  const x = [...a].map((c) => c.codePointAt(0)!);
  const y = [...b].map((c) => c.codePointAt(0)!);
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return x[i] - y[i];
  return x.length - y.length;
}

function pyNumber(n: number): string {
  if (Number.isInteger(n) && Math.abs(n) < 1e16) return String(n);
  if (Number.isNaN(n)) return 'NaN';
  if (!Number.isFinite(n)) return n > 0 ? 'Infinity' : '-Infinity';
  // float repr: shortest round-trip digits, exponent with at least two digits.
  let s = String(n);
  if (Math.abs(n) >= 1e16 && !s.includes('e')) s = n.toExponential();
  s = s.replace(/e([+-])(\d)$/, 'e$10$2');
  if (!s.includes('.') && !s.includes('e')) s += '.0';
  return s;
}

function pyString(s: string): string {
  let out = '"';
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c === 0x22) out += '\\"';
    else if (c === 0x5c) out += '\\\\';
    else if (c === 0x0a) out += '\\n';
    else if (c === 0x0d) out += '\\r';
    else if (c === 0x09) out += '\\t';
    else if (c === 0x08) out += '\\b';
    else if (c === 0x0c) out += '\\f';
    else if (c < 0x20 || c > 0x7e) out += `\\u${c.toString(16).padStart(4, '0')}`;
    else out += s[i];
  }
  return `${out}"`;
}

/** vLLM's hash_factors: sha256(json.dumps(factors, sort_keys=True)).hexdigest(). */
export function hashFactors(factors: { [k: string]: HashFactor }): string {
  return createHash('sha256').update(pyJsonDumps(factors), 'utf8').digest('hex');
}
