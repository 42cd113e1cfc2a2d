// The envelope a llama prefill puts around a sequence state in its KV blocks,
// so that a decode can prove, before llama.cpp sees a byte, that the state is
// whole, unchanged, from the same model and build, and fits its context:
// llama.cpp may crash on a state from another model or a truncated one.
//
//   offset  bytes
//   0       4   magic 'NNKV'
//   4       2   version (2)
//   6       2   header bytes (128)
//   8       16  the continuation: where the decode goes on (below)
//   24      8   state bytes
//   32      32  sha256 of the state
//   64      32  model fingerprint (modelFingerprint in llama.ts)
//   96      32  sha256 of bytes 0..96
//   128     ... the state: llama.cpp's sequence state file ('ggsq', version,
//               token count, tokens, the sequence's KV)
//
// The continuation (16 bytes, CONTINUATION_BYTES):
//   +0   4   tokens the state holds (llama.cpp's token count): the prompt,
//            evaluated in one batch, and nothing else
//   +4   4   the next token + 1 (0: none): the token sampled from the logits
//            of the state's last token, never evaluated; the decode's first
//            evaluation (llama-continue.ts)
//   +8   4   the seed of the sampler that drew it (temperature > 0)
//   +12  4   the sampling key: what chose it (samplingKey in llama.ts); a
//            decode asked to sample otherwise does not use the next token
import { createHash } from 'node:crypto';
import { KvRejected } from './types';

export const HEADER_BYTES = 128;
const MAGIC = 0x564b4e4e; // 'NNKV' little-endian
const VERSION = 2;
/** Bytes of the continuation block (at offset 8). */
export const CONTINUATION_BYTES = 16;
/** llama.cpp's LLAMA_STATE_SEQ_MAGIC ('ggsq'); its version is the build's, which the fingerprint covers. */
const SEQ_MAGIC = 0x67677371;

/** Where a decode goes on from a state (the continuation block). */
export interface Continuation {
  /** Tokens the state holds: the prompt as the prefill evaluated it. */
  stateTokens: number;
  /** The token sampled from the logits of the state's last token (never evaluated), if any. */
  nextToken?: number;
  /** The seed of the sampler that drew it (0 when greedy). */
  seed: number;
  /** What chose it: a 32-bit key of the sampling settings. */
  samplingKey: number;
}

export interface StateInfo extends Continuation {
  /** 32 bytes. */
  fingerprint: Buffer;
}

/** Writes the continuation block at `at`. */
export function writeContinuation(b: Buffer, at: number, c: Continuation): void {
  b.writeUInt32LE(c.stateTokens, at);
  b.writeUInt32LE(c.nextToken === undefined ? 0 : c.nextToken + 1, at + 4);
  b.writeUInt32LE(c.seed >>> 0, at + 8);
  b.writeUInt32LE(c.samplingKey >>> 0, at + 12);
}

/** Reads the continuation block at `at`. */
export function readContinuation(b: Buffer, at: number): Continuation {
  const next = b.readUInt32LE(at + 4);
  return {
    stateTokens: b.readUInt32LE(at),
    ...(next === 0 ? {} : { nextToken: next - 1 }),
    seed: b.readUInt32LE(at + 8),
    samplingKey: b.readUInt32LE(at + 12),
  };
}

/** Bytes the envelope of a state takes. */
export function envelopeBytes(stateBytes: number): number {
  return HEADER_BYTES + stateBytes;
}

/** The 128-byte header of a state. */
export function stateHeader(state: Buffer, info: StateInfo): Buffer {
  if (info.fingerprint.length !== 32) throw new RangeError('the fingerprint is 32 bytes');
  const h = Buffer.alloc(HEADER_BYTES);
  h.writeUInt32LE(MAGIC, 0);
  h.writeUInt16LE(VERSION, 4);
  h.writeUInt16LE(HEADER_BYTES, 6);
  writeContinuation(h, 8, info);
  h.writeBigUInt64LE(BigInt(state.length), 24);
  createHash('sha256').update(state).digest().copy(h, 32);
  info.fingerprint.copy(h, 64);
  createHash('sha256').update(h.subarray(0, 96)).digest().copy(h, 96);
  return h;
}

/** Writes header + state across blocks of blockBytes (view(i) is block i). */
export function writeEnvelope(header: Buffer, state: Buffer, blockBytes: number, view: (i: number) => Buffer): void {
  const whole = [header, state];
  let block = 0;
  let at = 0;
  for (const part of whole) {
    let off = 0;
    while (off < part.length) {
      const dst = view(block);
      const n = Math.min(part.length - off, blockBytes - at);
      part.copy(dst, at, off, off + n);
      off += n;
      at += n;
      if (at === blockBytes) {
        block++;
        at = 0;
      }
    }
  }
}

export interface OpenOptions {
  blocks: number;
  blockBytes: number;
  /** This decode's model fingerprint. */
  fingerprint: Buffer;
  /** Most tokens this decode's context takes. */
  maxTokens: number;
  /** Most state bytes this decode accepts. */
  maxStateBytes: number;
  /** Tokens of this decode's vocabulary: a next token must be one of them. */
  vocabularySize: number;
}

/**
 * Checks the envelope in blocks 0..blocks-1 of view and returns the state
 * (a copy) and its continuation; throws KvRejected naming what is wrong.
 * Nothing it returns was not checked.
 */
export function openEnvelope(view: (i: number) => Buffer, o: OpenOptions): Continuation & { state: Buffer } {
  const room = o.blocks * o.blockBytes;
  if (o.blocks < 1 || room < HEADER_BYTES)
    throw new KvRejected(`${o.blocks} blocks of ${o.blockBytes} bytes cannot hold a state`, 'truncated');
  const h = gather(view, o.blockBytes, 0, HEADER_BYTES);
  if (h.readUInt32LE(0) !== MAGIC)
    throw new KvRejected('the blocks hold no nixl-node KV state (bad magic)', 'malformed');
  if (h.readUInt16LE(4) !== VERSION || h.readUInt16LE(6) !== HEADER_BYTES)
    throw new KvRejected(`KV state version ${h.readUInt16LE(4)}: this decode reads version ${VERSION}`, 'malformed');
  if (!createHash('sha256').update(h.subarray(0, 96)).digest().equals(h.subarray(96, 128)))
    throw new KvRejected('the KV state header is corrupted (checksum)', 'corrupted');
  if (!h.subarray(64, 96).equals(o.fingerprint))
    throw new KvRejected(
      `the KV state is from another model or llama.cpp build (fingerprint ${h.subarray(64, 70).toString('hex')}, ` +
        `this decode's ${o.fingerprint.subarray(0, 6).toString('hex')})`,
      'foreign-model',
    );
  const c = readContinuation(h, 8);
  const promptTokens = c.stateTokens;
  if (c.nextToken !== undefined && c.nextToken >= o.vocabularySize)
    throw new KvRejected(
      `the KV state's next token ${c.nextToken} is not in this model's vocabulary of ${o.vocabularySize}`,
      'malformed',
    );
  const stateBig = h.readBigUInt64LE(24);
  if (stateBig > BigInt(o.maxStateBytes))
    throw new KvRejected(`a KV state of ${stateBig} bytes: this decode takes at most ${o.maxStateBytes}`, 'oversized');
  if (promptTokens > o.maxTokens)
    throw new KvRejected(
      `a KV state of ${promptTokens} tokens: this decode's context holds ${o.maxTokens}`,
      'oversized',
    );
  const stateBytes = Number(stateBig);
  if (HEADER_BYTES + stateBytes > room)
    throw new KvRejected(
      `the KV state is ${stateBytes} bytes but ${o.blocks} blocks hold ${room - HEADER_BYTES} after the header`,
      'truncated',
    );
  const state = gather(view, o.blockBytes, HEADER_BYTES, stateBytes);
  if (!createHash('sha256').update(state).digest().equals(h.subarray(32, 64)))
    throw new KvRejected('the KV state is corrupted (checksum)', 'corrupted');
  // llama.cpp's own header: a state for exactly the tokens the header claims.
  if (stateBytes < 12 || state.readUInt32LE(0) !== SEQ_MAGIC)
    throw new KvRejected('the KV state is not a llama.cpp sequence state', 'malformed');
  const n = state.readUInt32LE(8);
  if (n !== promptTokens || 12 + 4 * n > stateBytes)
    throw new KvRejected(`the KV state holds ${n} tokens, its header says ${promptTokens}`, 'malformed');
  return { ...c, state };
}

/** Bytes [from, from+len) of the envelope, copied out of the blocks. */
function gather(view: (i: number) => Buffer, blockBytes: number, from: number, len: number): Buffer {
  const out = Buffer.allocUnsafe(len);
  let done = 0;
  while (done < len) {
    const at = from + done;
    const b = Math.floor(at / blockBytes);
    const off = at % blockBytes;
    const n = Math.min(len - done, blockBytes - off);
    view(b).copy(out, done, off, off + n);
    done += n;
  }
  return out;
}

/** Test hook: ways a state can arrive damaged (each must be refused, nothing loaded). */
export type Tamper = 'truncate' | 'corrupt' | 'oversize' | 'foreign';

/** Damages the envelope in blocks 0..blocks-1 (a test hook of the prefill). */
export function tamperEnvelope(
  view: (block: number, layer: number) => Buffer,
  blocks: number,
  blockBytes: number,
  how: Tamper,
): void {
  const h = view(0, 0).subarray(0, HEADER_BYTES);
  const resealHeader = () => createHash('sha256').update(h.subarray(0, 96)).digest().copy(h, 96);
  switch (how) {
    case 'corrupt': {
      // One bit in the middle of the state.
      const stateBytes = Number(h.readBigUInt64LE(24));
      const at = HEADER_BYTES + Math.floor(stateBytes / 2);
      view(Math.floor(at / blockBytes), 0)[at % blockBytes] ^= 0x10;
      break;
    }
    case 'truncate':
      // The state claims one block more than there are.
      h.writeBigUInt64LE(BigInt(blocks * blockBytes), 24);
      resealHeader();
      break;
    case 'oversize':
      h.writeBigUInt64LE(1n << 40n, 24);
      resealHeader();
      break;
    case 'foreign':
      h.fill(0x42, 64, 96);
      resealHeader();
      break;
  }
}
