// Generated test models: small llama-architecture GGUFs for `nixl-node worker
// --model tiny`, the demo, the bench and the tests:
// nothing can be downloaded where they run, and a real GGUF is gigabytes.
// The weights are deterministic pseudo-random F32 (the same file on every
// machine for a given spec), the vocabulary is SentencePiece-style with only
// byte tokens (<0x00>..<0xFF>), so llama.cpp tokenizes any text byte by byte.
// Layout (GGUF v3): magic, version, tensor and key/value counts, typed
// key/values, tensor infos, then the tensor data aligned to 32 bytes. Tensor
// shapes are in ggml order: the first dimension is the innermost.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { NixlError } from '../../errors';

export interface GgufSpec {
  /** Model name (general.name). */
  name: string;
  embedding: number;
  layers: number;
  heads: number;
  kvHeads: number;
  feedForward: number;
  contextLength: number;
  /** Seed of the weights. */
  seed: number;
  /** What the output layer favours (default 'text'; see OutputBias). */
  output?: OutputBias;
}

/**
 * What a generated model's output layer lets it write. The other tokens get
 * zero rows (logit 0), so the model writes only these:
 * - 'text': lower-case letters, space, '.', ',' (readable, ASCII only);
 * - 'high-bytes': bytes 0x80-0xFF (128 pieces of multi-byte UTF-8
 *   characters, as byte-fallback vocabularies of real models write for
 *   Chinese, Russian or emoji) and the 29 text tokens: mostly pieces, with
 *   some text between them;
 * - 'unbiased': every token, control tokens and end of text included.
 */
export type OutputBias = 'text' | 'high-bytes' | 'unbiased';

/** The scale of output row `token` (0: a zero row) for a bias, relative to the random init. */
export function outputRowScale(bias: OutputBias, token: number): number {
  switch (bias) {
    case 'text':
      return TEXT_TOKENS.has(token) ? 4 : 0;
    case 'high-bytes':
      return token >= 3 + 0x80 || TEXT_TOKENS.has(token) ? 4 : 0;
    case 'unbiased':
      return 1;
  }
}

/** For tests: a few hundred KiB, 256 bytes of KV per token. */
export const TINY: GgufSpec = {
  name: 'nixl-node-tiny',
  embedding: 64,
  layers: 2,
  heads: 4,
  kvHeads: 2,
  feedForward: 128,
  contextLength: 4096,
  seed: 1,
};

/** For the bench: about 26 MiB, 8 KiB of KV per token (8 MiB for a 1000-token prompt). */
export const SMALL: GgufSpec = {
  name: 'nixl-node-small',
  embedding: 256,
  layers: 8,
  heads: 4,
  kvHeads: 4,
  feedForward: 688,
  contextLength: 4096,
  seed: 2,
};

/** TINY's shape, writing mostly pieces of multi-byte characters (tests of held-back pieces). */
export const TINY_UTF8: GgufSpec = { ...TINY, name: 'nixl-node-tiny-utf8', seed: 3, output: 'high-bytes' };

/** TINY's shape with an unbiased output layer: any token, end of text and control bytes included. */
export const TINY_UNBIASED: GgufSpec = { ...TINY, name: 'nixl-node-tiny-unbiased', seed: 4, output: 'unbiased' };

export const BUILTIN: Record<string, GgufSpec> = {
  tiny: TINY,
  small: SMALL,
  'tiny-utf8': TINY_UTF8,
  'tiny-unbiased': TINY_UNBIASED,
};

/** KV bytes per token of a model with this spec, with llama.cpp's default F16 cache. */
export function kvBytesPerToken(s: GgufSpec): number {
  return 2 * s.layers * (s.embedding / s.heads) * s.kvHeads * 2;
}

const VOCAB = ['<unk>', '<s>', '</s>', ...Array.from({ length: 256 }, (_, i) => `<0x${hex2(i)}>`)];

/** Token ids of a-z, space, '.', ',' (byte b is token 3 + b). */
const TEXT_TOKENS = new Set([...'abcdefghijklmnopqrstuvwxyz .,'].map((c) => 3 + c.charCodeAt(0)));

function hex2(i: number): string {
  return i.toString(16).toUpperCase().padStart(2, '0');
}

// GGUF value types
const T = { U32: 4, I32: 5, F32: 6, STRING: 8, ARRAY: 9 } as const;

class Writer {
  readonly parts: Buffer[] = [];
  size = 0;

  push(b: Buffer): void {
    this.parts.push(b);
    this.size += b.length;
  }
  u32(v: number): void {
    const b = Buffer.alloc(4);
    b.writeUInt32LE(v);
    this.push(b);
  }
  i32(v: number): void {
    const b = Buffer.alloc(4);
    b.writeInt32LE(v);
    this.push(b);
  }
  u64(v: number | bigint): void {
    const b = Buffer.alloc(8);
    b.writeBigUInt64LE(BigInt(v));
    this.push(b);
  }
  f32(v: number): void {
    const b = Buffer.alloc(4);
    b.writeFloatLE(v);
    this.push(b);
  }
  str(s: string): void {
    const b = Buffer.from(s, 'utf8');
    this.u64(b.length);
    this.push(b);
  }
  pad(align: number): void {
    const n = (align - (this.size % align)) % align;
    if (n) this.push(Buffer.alloc(n));
  }
}

type Kv =
  | [string, 'u32' | 'f32' | 'string', number | string]
  | [string, 'strings', string[]]
  | [string, 'f32s' | 'i32s', number[]];

function writeKv(w: Writer, [key, type, value]: Kv): void {
  w.str(key);
  switch (type) {
    case 'u32':
      w.u32(T.U32);
      w.u32(value as number);
      break;
    case 'f32':
      w.u32(T.F32);
      w.f32(value as number);
      break;
    case 'string':
      w.u32(T.STRING);
      w.str(value as string);
      break;
    case 'strings':
      w.u32(T.ARRAY);
      w.u32(T.STRING);
      w.u64((value as string[]).length);
      for (const s of value as string[]) w.str(s);
      break;
    case 'f32s':
      w.u32(T.ARRAY);
      w.u32(T.F32);
      w.u64((value as number[]).length);
      for (const v of value as number[]) w.f32(v);
      break;
    case 'i32s':
      w.u32(T.ARRAY);
      w.u32(T.I32);
      w.u64((value as number[]).length);
      for (const v of value as number[]) w.i32(v);
      break;
  }
}

interface Tensor {
  name: string;
  /** ggml order: dims[0] is the innermost. */
  dims: number[];
  /**
   * 'one': a norm's weights (all 1); 'random': uniform in +-1/sqrt(dims[0]);
   * 'output': row t scaled by outputRowScale(spec.output, t), so that the
   * model writes what the spec's output bias favours.
   */
  init: 'one' | 'random' | 'output';
}

function tensors(s: GgufSpec): Tensor[] {
  const headDim = s.embedding / s.heads;
  const kv = headDim * s.kvHeads;
  const e = s.embedding;
  const out: Tensor[] = [
    { name: 'token_embd.weight', dims: [e, VOCAB.length], init: 'random' },
    { name: 'output_norm.weight', dims: [e], init: 'one' },
    { name: 'output.weight', dims: [e, VOCAB.length], init: 'output' },
  ];
  for (let i = 0; i < s.layers; i++) {
    const b = `blk.${i}.`;
    out.push(
      { name: `${b}attn_norm.weight`, dims: [e], init: 'one' },
      { name: `${b}attn_q.weight`, dims: [e, e], init: 'random' },
      { name: `${b}attn_k.weight`, dims: [e, kv], init: 'random' },
      { name: `${b}attn_v.weight`, dims: [e, kv], init: 'random' },
      { name: `${b}attn_output.weight`, dims: [e, e], init: 'random' },
      { name: `${b}ffn_norm.weight`, dims: [e], init: 'one' },
      { name: `${b}ffn_gate.weight`, dims: [e, s.feedForward], init: 'random' },
      { name: `${b}ffn_up.weight`, dims: [e, s.feedForward], init: 'random' },
      { name: `${b}ffn_down.weight`, dims: [s.feedForward, e], init: 'random' },
    );
  }
  return out;
}

function checkSpec(s: GgufSpec): void {
  for (const k of ['embedding', 'layers', 'heads', 'kvHeads', 'feedForward', 'contextLength'] as const)
    if (!Number.isInteger(s[k]) || s[k] < 1 || s[k] > 1 << 16)
      throw new NixlError(`${k} must be an integer from 1 to 65536`, 'NIXL_ERR_INVALID_PARAM');
  if (s.embedding % s.heads !== 0)
    throw new NixlError('embedding must be a multiple of heads', 'NIXL_ERR_INVALID_PARAM');
  if (s.heads % s.kvHeads !== 0) throw new NixlError('heads must be a multiple of kvHeads', 'NIXL_ERR_INVALID_PARAM');
  if (s.output !== undefined && !['text', 'high-bytes', 'unbiased'].includes(s.output))
    throw new NixlError("output must be 'text', 'high-bytes' or 'unbiased'", 'NIXL_ERR_INVALID_PARAM');
}

/** The GGUF file of a spec, as bytes. */
export function buildGguf(s: GgufSpec): Buffer {
  checkSpec(s);
  const ts = tensors(s);
  const w = new Writer();
  const kvs: Kv[] = [
    ['general.architecture', 'string', 'llama'],
    ['general.name', 'string', s.name],
    ['general.alignment', 'u32', 32],
    ['llama.context_length', 'u32', s.contextLength],
    ['llama.embedding_length', 'u32', s.embedding],
    ['llama.block_count', 'u32', s.layers],
    ['llama.feed_forward_length', 'u32', s.feedForward],
    ['llama.attention.head_count', 'u32', s.heads],
    ['llama.attention.head_count_kv', 'u32', s.kvHeads],
    ['llama.rope.dimension_count', 'u32', s.embedding / s.heads],
    ['llama.attention.layer_norm_rms_epsilon', 'f32', 1e-5],
    ['tokenizer.ggml.model', 'string', 'llama'],
    ['tokenizer.ggml.tokens', 'strings', VOCAB],
    ['tokenizer.ggml.scores', 'f32s', VOCAB.map(() => 0)],
    // 2: unknown, 3: control, 6: byte
    ['tokenizer.ggml.token_type', 'i32s', VOCAB.map((_, i) => (i === 0 ? 2 : i < 3 ? 3 : 6))],
    ['tokenizer.ggml.unknown_token_id', 'u32', 0],
    ['tokenizer.ggml.bos_token_id', 'u32', 1],
    ['tokenizer.ggml.eos_token_id', 'u32', 2],
  ];
  w.push(Buffer.from('GGUF', 'ascii'));
  w.u32(3);
  w.u64(ts.length);
  w.u64(kvs.length);
  for (const kv of kvs) writeKv(w, kv);
  let offset = 0;
  for (const t of ts) {
    w.str(t.name);
    w.u32(t.dims.length);
    for (const d of t.dims) w.u64(d);
    w.u32(0); // F32
    w.u64(offset);
    offset += align(count(t) * 4, 32);
  }
  w.pad(32);
  const rand = xorshift(s.seed);
  const bias = s.output ?? 'text';
  for (const t of ts) {
    const n = count(t);
    const data = new Float32Array(align(n * 4, 32) / 4);
    for (let i = 0; i < n; i++) {
      const k = t.init === 'output' ? outputRowScale(bias, Math.floor(i / t.dims[0])) : 1;
      const r = (rand() * 2 - 1) * ((Math.sqrt(3) * k) / Math.sqrt(t.dims[0]));
      if (t.init === 'one') data[i] = 1;
      else if (k === 0) data[i] = 0;
      else data[i] = r;
    }
    w.push(Buffer.from(data.buffer));
  }
  return Buffer.concat(w.parts);
}

function count(t: Tensor): number {
  return t.dims.reduce((a, b) => a * b, 1);
}

function align(n: number, a: number): number {
  return Math.ceil(n / a) * a;
}

/** Uniform [0, 1), the same sequence on every machine. */
function xorshift(seed: number): () => number {
  let x = (seed * 0x9e3779b1) >>> 0 || 1;
  return () => {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return x / 0x1_0000_0000;
  };
}

/** Writes the GGUF of a spec to file (atomically: other processes may be reading the same path). */
export function writeGguf(file: string, s: GgufSpec): void {
  const tmp = `${file}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, buildGguf(s));
  fs.renameSync(tmp, file);
}

/**
 * The path of a built-in model ('tiny', 'small'), generated on first use
 * into a cache directory (default: the OS temp dir); any other name is a
 * GGUF path and comes back as is.
 */
export function modelPath(nameOrPath: string, dir = path.join(os.tmpdir(), 'nixl-node-models')): string {
  const spec = BUILTIN[nameOrPath];
  if (!spec) return nameOrPath;
  const id = createHash('sha256').update(JSON.stringify(spec)).digest('hex').slice(0, 12);
  const file = path.join(dir, id, `${spec.name}.gguf`);
  if (!fs.existsSync(file)) {
    fs.mkdirSync(path.dirname(file), { recursive: true });
    writeGguf(file, spec);
  }
  return file;
}
