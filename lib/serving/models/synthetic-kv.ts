// A synthetic model for the serving demo and tests: no weights, but every
// step is checkable. Tokens are the prompt's UTF-8 bytes; the KV of block b
// at layer l is a pseudo-random fill seeded by sha256(tokens of blocks
// 0..b, l), so it depends on the whole prefix, as real KV does; the
// "generated" words are derived from a digest of the KV the decode worker
// holds, so a client that knows the prompt can tell whether the right KV
// arrived.
import { createHash } from 'node:crypto';

/** The synthetic model's KV geometry. */
export interface SyntheticModelSpec {
  /** Tokens per block. */
  blockSize: number;
  layers: number;
  /** Bytes of one block of one layer. */
  blockBytes: number;
}

/** The geometry workers use unless told otherwise. */
export const DEFAULT_MODEL: SyntheticModelSpec = { blockSize: 16, layers: 4, blockBytes: 4096 };
/** The synthetic model's name in answers. */
export const MODEL_NAME = 'nixl-node/synthetic';

const WORDS = (
  'alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa ' +
  'quebec romeo sierra tango uniform victor whiskey xray yankee zulu'
).split(' ');

/** The synthetic model's tokens: the prompt's UTF-8 bytes. */
export function tokenize(prompt: string): Uint8Array {
  return new Uint8Array(Buffer.from(prompt, 'utf8'));
}

/** The prompt a chat request stands for: "role: content" lines, text parts and image URLs alike. */
export function chatPrompt(messages: unknown): string {
  if (!Array.isArray(messages)) throw new TypeError('messages must be an array');
  return messages
    .map((m) => {
      const { role, content } = m as { role?: unknown; content?: unknown };
      const parts = Array.isArray(content)
        ? content.map((p) => {
            const q = p as { type?: string; text?: string; image_url?: { url?: string } };
            return q.type === 'image_url' ? `<image ${q.image_url?.url ?? ''}>` : String(q.text ?? '');
          })
        : [String(content ?? '')];
      return `${String(role)}: ${parts.join(' ')}`;
    })
    .join('\n');
}

/** KV blocks a prompt of this many tokens takes (at least one). */
export function numBlocks(tokens: number, spec: SyntheticModelSpec): number {
  return Math.max(1, Math.ceil(tokens / spec.blockSize));
}

/** Seeds of every block (prefix hashes). */
function blockSeeds(tokens: Uint8Array, spec: SyntheticModelSpec): Buffer[] {
  const n = numBlocks(tokens.length, spec);
  const h = createHash('sha256');
  const out: Buffer[] = [];
  for (let b = 0; b < n; b++) {
    h.update(tokens.subarray(b * spec.blockSize, (b + 1) * spec.blockSize));
    out.push(h.copy().digest());
  }
  return out;
}

/** xorshift32 fill: fast, and the same in every process. */
function fill(dst: Buffer, seed: Buffer, layer: number): void {
  let x = (seed.readUInt32LE(0) ^ Math.imul(layer + 1, 0x9e3779b1)) >>> 0 || 1;
  const words = dst.length >>> 2;
  for (let i = 0; i < words; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    dst.writeUInt32LE(x, i << 2);
  }
}

/** Writes the KV of every block of the prompt from `fromBlock` on: write(logicalBlock, layer) gives the destination. */
export function computeKv(
  tokens: Uint8Array,
  spec: SyntheticModelSpec,
  write: (block: number, layer: number) => Buffer,
  fromBlock = 0,
): void {
  blockSeeds(tokens, spec).forEach((seed, b) => {
    if (b < fromBlock) return;
    for (let l = 0; l < spec.layers; l++) fill(write(b, l), seed, l);
  });
}

/** Bytes of the KV the prompt should have that differ from what read() holds (0: all right). */
export function checkKv(
  tokens: Uint8Array,
  spec: SyntheticModelSpec,
  read: (block: number, layer: number) => Buffer,
): number {
  const want = Buffer.alloc(spec.blockBytes);
  let bad = 0;
  blockSeeds(tokens, spec).forEach((seed, b) => {
    for (let l = 0; l < spec.layers; l++) {
      fill(want, seed, l);
      const got = read(b, l);
      if (!got.equals(want)) for (let i = 0; i < want.length; i++) if (got[i] !== want[i]) bad++;
    }
  });
  return bad;
}

/** The words a decode "generates" from the KV it holds. */
export function generate(
  read: (block: number, layer: number) => Buffer,
  blocks: number,
  spec: SyntheticModelSpec,
  maxTokens: number,
): string[] {
  const h = createHash('sha256');
  for (let b = 0; b < blocks; b++) for (let l = 0; l < spec.layers; l++) h.update(read(b, l));
  let d = h.digest();
  const out: string[] = [];
  for (let i = 0; i < maxTokens; i++) {
    if (i % 16 === 0 && i > 0) d = createHash('sha256').update(d).digest();
    out.push(WORDS[d[i % 16] % WORDS.length]);
  }
  return out;
}

/** What a client expects for a prompt: the words generated from the right KV. */
export function expectedCompletion(
  prompt: string,
  maxTokens: number,
  spec: SyntheticModelSpec = DEFAULT_MODEL,
): string[] {
  const tokens = tokenize(prompt);
  const blocks = numBlocks(tokens.length, spec);
  const kv = Array.from({ length: blocks * spec.layers }, () => Buffer.alloc(spec.blockBytes));
  computeKv(tokens, spec, (b, l) => kv[b * spec.layers + l]);
  return generate((b, l) => kv[b * spec.layers + l], blocks, spec, maxTokens);
}
