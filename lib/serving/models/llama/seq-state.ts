// A parser of llama.cpp's sequence state file (llama_state_seq_save_file,
// LLAMA_STATE_SEQ_VERSION 3, one llama_kv_cache) for the model and context at
// hand: a decode runs it over every state before llama.cpp sees a byte, since
// llama.cpp trusts the file (an out-of-vocabulary token, a position of 2^31-1,
// a cell count of 2^31 or a file one byte short crash, poison or exhaust it).
// It accepts exactly what an honest prefill of this model saves: tokens below
// the vocabulary size, one cell per token at positions 0..n-1 of sequence 0,
// the model's layer count, K / V types and row sizes, its V transposition, and
// nothing after the last byte.
//
//   u32 'ggsq'  u32 version (3)  u32 n_tokens  i32 tokens[n_tokens]
//   u32 n_stream (1)  u32 cell_count
//   cell_count x { i32 pos  u32 n_seq_id (1)  i32 seq_id }
//   u32 v_trans  u32 n_layer
//   n_layer x { i32 k_type  u64 k_row_bytes  k_row_bytes x cell_count }
//   v_trans 0: n_layer x { i32 v_type  u64 v_row_bytes  v_row_bytes x cell_count }
//   v_trans 1: n_layer x { i32 v_type  u32 v_element_bytes  u32 n_embd_v_gqa
//                          n_embd_v_gqa x cell_count x v_element_bytes }
// (llama.cpp's src/llama-context.cpp state_seq_save_file and
// src/llama-kv-cache.cpp state_write / state_read_meta / state_read_data.)
import { KvRejected } from '../types';

/** llama.cpp's LLAMA_STATE_SEQ_MAGIC ('ggsq') and LLAMA_STATE_SEQ_VERSION. */
export const SEQ_MAGIC = 0x67677371;
export const SEQ_VERSION = 3;

/** What a state of one model and context must look like. */
export interface LlamaStateLayout {
  /** Tokens of the vocabulary: every token id is below it. */
  nVocab: number;
  /** Cells of the decode's context: the most tokens a state may hold. */
  nCtx: number;
  /** n_embd_k_gqa and n_embd_v_gqa of each layer. */
  embdK: number[];
  embdV: number[];
  /** ggml types of the K and V cache. */
  kType: number;
  vType: number;
  /** V stored transposed (llama.cpp without flash attention). */
  vTrans: boolean;
}

/** What a state holds, once it parsed. */
export interface ParsedState {
  tokens: number[];
  cells: number;
}

/** ggml types a KV cache can have: [bytes of a block, elements of a block]. */
const GGML_TYPES: Record<number, [number, number]> = {
  0: [4, 1], // F32
  1: [2, 1], // F16
  2: [18, 32], // Q4_0
  3: [20, 32], // Q4_1
  6: [22, 32], // Q5_0
  7: [24, 32], // Q5_1
  8: [34, 32], // Q8_0
  20: [18, 32], // IQ4_NL
  30: [2, 1], // BF16
};

/** ggml_row_size: bytes of `n` elements of `type` (undefined: not a KV type, or n not whole blocks). */
export function ggmlRowSize(type: number, n: number): number | undefined {
  const t = GGML_TYPES[type];
  if (!t || n % t[1] !== 0) return undefined;
  return (n / t[1]) * t[0];
}

/** ggml_type_size: bytes of one block of `type`. */
export function ggmlTypeSize(type: number): number | undefined {
  return GGML_TYPES[type]?.[0];
}

/** Bounds-checked little-endian reads: past the end is a KvRejected, never a read. */
class Reader {
  at = 0;
  constructor(readonly b: Buffer) {}

  need(n: number, what: string): void {
    if (n > this.b.length - this.at)
      throw new KvRejected(
        `the llama.cpp state ends at byte ${this.b.length}, inside ${what} (${n} bytes at ${this.at})`,
        'truncated',
      );
  }
  u32(what: string): number {
    this.need(4, what);
    const v = this.b.readUInt32LE(this.at);
    this.at += 4;
    return v;
  }
  i32(what: string): number {
    this.need(4, what);
    const v = this.b.readInt32LE(this.at);
    this.at += 4;
    return v;
  }
  u64(what: string): number {
    this.need(8, what);
    const v = this.b.readBigUInt64LE(this.at);
    this.at += 8;
    return v > BigInt(Number.MAX_SAFE_INTEGER) ? Number.MAX_SAFE_INTEGER : Number(v);
  }
  skip(n: number, what: string): void {
    this.need(n, what);
    this.at += n;
  }
}

function bad(message: string): KvRejected {
  return new KvRejected(`the llama.cpp state is not one this model saves: ${message}`, 'malformed');
}

function expect(got: number, want: number, what: string): void {
  if (got !== want) throw bad(`${what} is ${got}, this model's is ${want}`);
}

/**
 * Parses a sequence state for the model and context `L` describes; throws
 * KvRejected (truncated, malformed, oversized) at the first byte that is not
 * what an honest prefill of this model writes. Allocates nothing sized by
 * the state's own counts before they are checked.
 */
export function parseSeqState(b: Buffer, L: LlamaStateLayout): ParsedState {
  const r = new Reader(b);
  if (r.u32('the magic') !== SEQ_MAGIC) throw bad("no 'ggsq' magic");
  expect(r.u32('the version'), SEQ_VERSION, 'the version');
  const nTokens = r.u32('the token count');
  if (nTokens > L.nCtx)
    throw new KvRejected(`the llama.cpp state holds ${nTokens} tokens; this context holds ${L.nCtx}`, 'oversized');
  r.need(4 * nTokens, 'the tokens');
  const tokens = new Array<number>(nTokens);
  for (let i = 0; i < nTokens; i++) {
    const t = r.u32('a token');
    if (t >= L.nVocab) throw bad(`token ${i} is ${t}, outside the vocabulary of ${L.nVocab}`);
    tokens[i] = t;
  }
  expect(r.u32('the stream count'), 1, 'the stream count');
  const cells = r.u32('the cell count');
  if (cells > L.nCtx)
    throw new KvRejected(`the llama.cpp state holds ${cells} cells; this context holds ${L.nCtx}`, 'oversized');
  expect(cells, nTokens, 'the cell count (one cell per token)');
  if (cells === 0) return end(r, tokens, 0);
  r.need(12 * cells, 'the cells');
  for (let i = 0; i < cells; i++) {
    expect(r.i32('a position'), i, `the position of cell ${i}`);
    expect(r.u32('a sequence count'), 1, `the sequence count of cell ${i}`);
    expect(r.i32('a sequence id'), 0, `the sequence of cell ${i}`);
  }
  expect(r.u32('the V transposition'), L.vTrans ? 1 : 0, 'the V transposition');
  const nLayer = L.embdK.length;
  expect(r.u32('the layer count'), nLayer, 'the layer count');
  for (let l = 0; l < nLayer; l++) {
    expect(r.i32('a K type'), L.kType, `the K type of layer ${l}`);
    const row = ggmlRowSize(L.kType, L.embdK[l]) ?? -1;
    expect(r.u64('a K row size'), row, `the K row size of layer ${l}`);
    r.skip(row * cells, `the K of layer ${l}`);
  }
  for (let l = 0; l < nLayer; l++) {
    expect(r.i32('a V type'), L.vType, `the V type of layer ${l}`);
    if (!L.vTrans) {
      const row = ggmlRowSize(L.vType, L.embdV[l]) ?? -1;
      expect(r.u64('a V row size'), row, `the V row size of layer ${l}`);
      r.skip(row * cells, `the V of layer ${l}`);
    } else {
      const el = ggmlTypeSize(L.vType) ?? -1;
      expect(r.u32('a V element size'), el, `the V element size of layer ${l}`);
      expect(r.u32('a V width'), L.embdV[l], `n_embd_v_gqa of layer ${l}`);
      r.skip(L.embdV[l] * cells * el, `the V of layer ${l}`);
    }
  }
  return end(r, tokens, cells);
}

function end(r: Reader, tokens: number[], cells: number): ParsedState {
  if (r.at !== r.b.length) throw bad(`${r.b.length - r.at} bytes after its end (at ${r.at})`);
  return { tokens, cells };
}

/** The KV geometry of a GGUF from its metadata (per layer n_embd_k_gqa, n_embd_v_gqa); undefined when it says too little. */
export function kvGeometry(metadata: unknown): { embdK: number[]; embdV: number[] } | undefined {
  const md = metadata as Record<string, Record<string, unknown>> | undefined;
  const arch = md?.general?.architecture;
  if (typeof arch !== 'string') return undefined;
  const a = md?.[arch] as
    | { block_count?: number; embedding_length?: number; attention?: Record<string, unknown> }
    | undefined;
  const nLayer = a?.block_count;
  const nEmbd = a?.embedding_length;
  const att = a?.attention ?? {};
  if (!Number.isInteger(nLayer) || !Number.isInteger(nEmbd) || (nLayer as number) < 1) return undefined;
  const perLayer = (v: unknown, l: number): number | undefined =>
    Array.isArray(v) ? (v[l] as number) : typeof v === 'number' ? v : undefined;
  const embdK: number[] = [];
  const embdV: number[] = [];
  for (let l = 0; l < (nLayer as number); l++) {
    const heads = perLayer(att.head_count, l);
    const kvHeads = perLayer(att.head_count_kv, l) ?? heads;
    if (!heads || kvHeads === undefined) return undefined;
    const headK = (att.key_length as number | undefined) ?? (nEmbd as number) / heads;
    const headV = (att.value_length as number | undefined) ?? (nEmbd as number) / heads;
    if (!Number.isInteger(headK) || !Number.isInteger(headV)) return undefined;
    embdK.push(headK * kvHeads);
    embdV.push(headV * kvHeads);
  }
  return { embdK, embdV };
}

/**
 * The layout of a model's states, from its metadata and a state its own
 * llama.cpp saved (the cache types and V transposition the context chose):
 * the probe must parse with it, or this model's states cannot be checked.
 */
export function learnLayout(
  probe: Buffer,
  geometry: { embdK: number[]; embdV: number[] },
  nVocab: number,
  nCtx: number,
): LlamaStateLayout {
  const r = new Reader(probe);
  r.skip(8, 'the magic and version');
  const n = r.u32('the token count');
  r.skip(4 * n + 4, 'the tokens and stream count');
  const cells = r.u32('the cell count');
  r.skip(12 * cells, 'the cells');
  const vTrans = r.u32('the V transposition') === 1;
  r.skip(4, 'the layer count');
  const kType = r.i32('the K type');
  // The first V type: after every layer's K.
  const kRow = r.u64('the K row size');
  r.skip(kRow * cells, 'the K of layer 0');
  for (let l = 1; l < geometry.embdK.length; l++) {
    r.skip(4, 'a K type');
    const row = r.u64('a K row size');
    r.skip(row * cells, 'a K');
  }
  const vType = r.i32('the V type');
  const layout: LlamaStateLayout = { nVocab, nCtx, ...geometry, kType, vType, vTrans };
  parseSeqState(probe, layout);
  return layout;
}

/**
 * The state of the first `keep` tokens of a state that parsed with `L`
 * (parseSeqState): what llama.cpp saves for a sequence that evaluated only
 * those tokens, each cell's K and V unchanged. A prefill loads a previous
 * turn's state cut to the tokens it provably shares with its prompt.
 */
export function truncateSeqState(b: Buffer, L: LlamaStateLayout, keep: number): Buffer {
  const { tokens, cells } = parseSeqState(b, L);
  if (!Number.isInteger(keep) || keep < 0 || keep > cells)
    throw new RangeError(`cannot keep ${keep} of a state's ${cells} tokens`);
  const parts: Buffer[] = [];
  const u32 = (v: number) => {
    const x = Buffer.alloc(4);
    x.writeUInt32LE(v >>> 0);
    parts.push(x);
  };
  u32(SEQ_MAGIC);
  u32(SEQ_VERSION);
  u32(keep);
  for (let i = 0; i < keep; i++) u32(tokens[i]);
  u32(1);
  u32(keep);
  if (keep === 0) return Buffer.concat(parts);
  for (let i = 0; i < keep; i++) {
    u32(i); // position
    u32(1); // one sequence
    u32(0); // sequence 0
  }
  u32(L.vTrans ? 1 : 0);
  u32(L.embdK.length);
  // After the header: n_tokens, tokens, n_stream, cell_count, cells, v_trans, n_layer.
  let at = 12 + 4 * tokens.length + 8 + 12 * cells + 8;
  const rows = (row: number) => {
    parts.push(b.subarray(at, at + 12)); // type and row size
    at += 12;
    parts.push(b.subarray(at, at + row * keep));
    at += row * cells;
  };
  for (let l = 0; l < L.embdK.length; l++) rows(ggmlRowSize(L.kType, L.embdK[l]) as number);
  for (let l = 0; l < L.embdV.length; l++) {
    if (!L.vTrans) {
      rows(ggmlRowSize(L.vType, L.embdV[l]) as number);
      continue;
    }
    // Transposed: each of the n_embd_v_gqa rows runs over all the cells.
    const el = ggmlTypeSize(L.vType) as number;
    parts.push(b.subarray(at, at + 12)); // type, element size, width
    at += 12;
    for (let j = 0; j < L.embdV[l]; j++) parts.push(b.subarray(at + j * cells * el, at + (j * cells + keep) * el));
    at += L.embdV[l] * cells * el;
  }
  return Buffer.concat(parts);
}
