// The envelope a llama prefill puts around a sequence state in its KV blocks,
// so that a decode can prove, before llama.cpp sees a byte, that the state is
// whole, unchanged, from the same model and build, made for the request the
// decode was given, and fits its context (the state itself is then parsed by
// llama/seq-state.ts). Version 3:
//
//   offset  bytes
//   0       4    magic 'NNKV'
//   4       2    version (3)
//   6       2    header bytes (256)
//   8       4    flags, what the MAC field holds: bit 0, an HMAC-SHA256 keyed
//                by the deployment's KV secret; bit 1, an XXH64 checksum
//                (state-checksum.ts) in its first 8 bytes, the rest 0;
//                neither, a plain SHA-256 checksum (what earlier prefills
//                wrote: still read); both, malformed
//   12      4    reserved (0)
//   16      8    state bytes
//   24      32   model fingerprint (modelFingerprint in llama.ts)
//   56      32   binding: the request the state was made for (bindingDigest)
//   88      136  fields (ENVELOPE_FIELDS below; bytes no field names are 0)
//   224     32   MAC of bytes 0..224 and the state (flags say which)
//   256     ...  the state: llama.cpp's sequence state file
//
// Fields that say what the state holds go in ENVELOPE_FIELDS (offsets inside 88..224)
// and StateInfo, read and written by writeFields / readFields only. Now the
// continuation, where the decode goes on (continue.ts):
//
//   88   4   tokens the state holds (llama.cpp's token count): the prompt,
//            evaluated in one batch, and nothing else
//   92   4   the next token + 1 (0: none): the token sampled from the logits
//            of the state's last token, never evaluated
//   96   4   the seed of the sampler that drew it (temperature > 0)
//   100  4   the sampling key: what chose it (samplingKey in llama.ts); a
//            decode asked to sample otherwise does not use the next token
//   104  4   the batch size B its tokens were evaluated in, from position 0
//            (0: not said): a next turn reuses a held turn's whole batches
//            only when it evaluates in batches of the same B
import { createHash, createHmac, timingSafeEqual } from 'node:crypto';
import { NixlError } from '../../errors';
import { stateChecksum } from './state-checksum';
import { KvRejected, type KvBinding } from './types';

export const HEADER_BYTES = 256;
const MAGIC = 0x564b4e4e; // 'NNKV' little-endian
export const ENVELOPE_VERSION = 3;
const FLAG_HMAC = 1;
const FLAG_XXH64 = 2;
const MAC_PREFIX = 'nixl-node kv state v2\n';
const AT = { flags: 8, reserved: 12, stateBytes: 16, fingerprint: 24, binding: 56, fields: 88, mac: 224 } as const;
/** The fields, offsets from the start of the header. */
export const ENVELOPE_FIELDS = {
  promptTokens: 88, // u32: tokens the state holds
  nextToken: 92, // u32: the next token + 1 (0: none)
  seed: 96, // u32
  samplingKey: 100, // u32
  batch: 104, // u32
} as const;
const FIELDS_USED = 108; // first byte after the last field

/** Where a decode goes on from a state (the continuation fields). */
export interface Continuation {
  /** Tokens the state holds: the prompt as the prefill evaluated it. */
  promptTokens: number;
  /** The token sampled from the logits of the state's last token (never evaluated), if any. */
  nextToken?: number;
  /** The seed of the sampler that drew it (0 when greedy). */
  seed: number;
  /** What chose it: a 32-bit key of the sampling settings. */
  samplingKey: number;
  /** The batch size its tokens were evaluated in from position 0 (0 or absent: not said). */
  batch?: number;
}

export interface StateInfo extends Continuation {
  /** 32 bytes. */
  fingerprint: Buffer;
  /** The request the state is for (bound into the envelope, checked by the decode). */
  binding: KvBinding;
}

/** Bytes the envelope of a state takes. */
export function envelopeBytes(stateBytes: number): number {
  return HEADER_BYTES + stateBytes;
}

/** sha256 of the request a state is for: the prefill's engine, the request id, the block ids. */
export function bindingDigest(b: KvBinding): Buffer {
  return createHash('sha256')
    .update('nixl-node kv binding\n')
    .update(JSON.stringify([b.engineId, b.requestId, [...b.blockIds]]))
    .digest();
}

function writeFields(h: Buffer, info: Continuation): void {
  h.writeUInt32LE(info.promptTokens, ENVELOPE_FIELDS.promptTokens);
  h.writeUInt32LE(info.nextToken === undefined ? 0 : info.nextToken + 1, ENVELOPE_FIELDS.nextToken);
  h.writeUInt32LE(info.seed >>> 0, ENVELOPE_FIELDS.seed);
  h.writeUInt32LE(info.samplingKey >>> 0, ENVELOPE_FIELDS.samplingKey);
  h.writeUInt32LE((info.batch ?? 0) >>> 0, ENVELOPE_FIELDS.batch);
}

function readFields(h: Buffer): Continuation {
  const next = h.readUInt32LE(ENVELOPE_FIELDS.nextToken);
  return {
    promptTokens: h.readUInt32LE(ENVELOPE_FIELDS.promptTokens),
    ...(next === 0 ? {} : { nextToken: next - 1 }),
    seed: h.readUInt32LE(ENVELOPE_FIELDS.seed),
    samplingKey: h.readUInt32LE(ENVELOPE_FIELDS.samplingKey),
    batch: h.readUInt32LE(ENVELOPE_FIELDS.batch),
  };
}

/**
 * The MAC field of a header (over its first 224 bytes) and state, 32 bytes, as
 * the header's flags say: an HMAC-SHA256 with the secret, an XXH64 checksum
 * (then 0s), or a SHA-256 checksum.
 */
function mac(header: Buffer, state: Buffer, secret: string | undefined): Buffer {
  const flags = header.readUInt32LE(AT.flags);
  if ((flags & FLAG_XXH64) !== 0) {
    const out = Buffer.alloc(32);
    stateChecksum([Buffer.from(MAC_PREFIX), header.subarray(0, AT.mac), state]).copy(out);
    return out;
  }
  const h = secret === undefined ? createHash('sha256') : createHmac('sha256', secret);
  return h.update(MAC_PREFIX).update(header.subarray(0, AT.mac)).update(state).digest();
}

/** The header of a state, sealed (an HMAC with `secret`, else a checksum). */
export function stateHeader(state: Buffer, info: StateInfo, secret?: string): Buffer {
  if (info.fingerprint.length !== 32) throw new NixlError('the fingerprint is 32 bytes', 'NIXL_ERR_INVALID_PARAM');
  const h = Buffer.alloc(HEADER_BYTES);
  h.writeUInt32LE(MAGIC, 0);
  h.writeUInt16LE(ENVELOPE_VERSION, 4);
  h.writeUInt16LE(HEADER_BYTES, 6);
  h.writeUInt32LE(secret === undefined ? FLAG_XXH64 : FLAG_HMAC, AT.flags);
  h.writeBigUInt64LE(BigInt(state.length), AT.stateBytes);
  info.fingerprint.copy(h, AT.fingerprint);
  bindingDigest(info.binding).copy(h, AT.binding);
  writeFields(h, info);
  mac(h, state, secret).copy(h, AT.mac);
  return h;
}

/**
 * Seals an envelope again after its bytes changed (header and state in one
 * buffer): what a prefill that writes a bad state, or anyone who knows the
 * secret (or, without one, anyone at all), can do. Tests use it.
 */
export function resealEnvelope(envelope: Buffer, secret?: string): void {
  if (envelope.length < HEADER_BYTES) return;
  const h = envelope.subarray(0, HEADER_BYTES);
  const n = Number(h.readBigUInt64LE(AT.stateBytes));
  const state = envelope.subarray(HEADER_BYTES, HEADER_BYTES + Math.min(n, envelope.length - HEADER_BYTES));
  mac(h, state, secret).copy(h, AT.mac);
}

/** Writes header + state across blocks of blockBytes (view(i) is block i). */
export function writeEnvelope(header: Buffer, state: Buffer, blockBytes: number, view: (i: number) => Buffer): void {
  let at = 0;
  for (const part of [header, state]) {
    scatter(view, blockBytes, at, part);
    at += part.length;
  }
}

export interface OpenOptions {
  blocks: number;
  blockBytes: number;
  /** This decode's model fingerprint. */
  fingerprint: Buffer;
  /** The request this decode was given (its kv_transfer_params): the state must be bound to it. */
  binding: KvBinding;
  /** The deployment's KV secret: the envelope must carry an HMAC with it. */
  secret?: string;
  /** Most tokens this decode's context takes. */
  maxTokens: number;
  /** Most state bytes this decode accepts. */
  maxStateBytes: number;
  /**
   * Where the state is copied to (default: a new buffer): `take(n)` a buffer
   * of n bytes, `give` it back when the envelope is refused.
   */
  into?: { take(bytes: number): Buffer; give(b: Buffer): void };
}

/**
 * Checks the envelope in blocks 0..blocks-1 of view and returns the state
 * (a copy) and what its fields say; throws KvRejected naming what is wrong.
 * Nothing it returns was not checked (the state's own bytes: llama/seq-state.ts).
 */
export function openEnvelope(view: (i: number) => Buffer, o: OpenOptions): Continuation & { state: Buffer } {
  const room = o.blocks * o.blockBytes;
  if (o.blocks < 1 || room < HEADER_BYTES)
    throw new KvRejected(`${o.blocks} blocks of ${o.blockBytes} bytes cannot hold a state`, 'truncated');
  const h = gather(view, o.blockBytes, 0, HEADER_BYTES);
  if (h.readUInt32LE(0) !== MAGIC)
    throw new KvRejected('the blocks hold no nixl-node KV state (bad magic)', 'malformed');
  if (h.readUInt16LE(4) !== ENVELOPE_VERSION || h.readUInt16LE(6) !== HEADER_BYTES)
    throw new KvRejected(
      `KV state envelope version ${h.readUInt16LE(4)}: this decode reads version ${ENVELOPE_VERSION}`,
      'version',
    );
  const flags = h.readUInt32LE(AT.flags);
  if ((flags & ~(FLAG_HMAC | FLAG_XXH64)) !== 0 || flags === (FLAG_HMAC | FLAG_XXH64))
    throw new KvRejected(`unknown KV state flags 0x${flags.toString(16)}`, 'malformed');
  if ((flags & FLAG_HMAC) === 0 && o.secret !== undefined)
    throw new KvRejected('the KV state is not authenticated and this decode requires a KV secret', 'unauthenticated');
  if ((flags & FLAG_HMAC) !== 0 && o.secret === undefined)
    throw new KvRejected(
      'the KV state is authenticated with a KV secret this decode does not have (give it --kv-secret)',
      'unauthenticated',
    );
  const stateBig = h.readBigUInt64LE(AT.stateBytes);
  if (stateBig > BigInt(o.maxStateBytes))
    throw new KvRejected(`a KV state of ${stateBig} bytes: this decode takes at most ${o.maxStateBytes}`, 'oversized');
  const stateBytes = Number(stateBig);
  if (HEADER_BYTES + stateBytes > room)
    throw new KvRejected(
      `the KV state is ${stateBytes} bytes but ${o.blocks} blocks hold ${room - HEADER_BYTES} after the header`,
      'truncated',
    );
  const state = o.into?.take(stateBytes) ?? Buffer.allocUnsafe(stateBytes);
  try {
    gather(view, o.blockBytes, HEADER_BYTES, stateBytes, state);
    return { state, ...checkSealed(h, state, o) };
  } catch (e) {
    o.into?.give(state);
    throw e;
  }
}

/** The checks of a header whose state is gathered: its MAC first, then what the header says. */
function checkSealed(h: Buffer, state: Buffer, o: OpenOptions): Continuation {
  if (!timingSafeEqual(mac(h, state, o.secret), h.subarray(AT.mac, AT.mac + 32)))
    throw o.secret === undefined
      ? new KvRejected('the KV state is corrupted (checksum)', 'corrupted')
      : new KvRejected('the KV state HMAC does not match: forged, altered, or another secret', 'unauthenticated');
  if (h.readUInt32LE(AT.reserved) !== 0 || h.subarray(FIELDS_USED, AT.mac).some((x) => x !== 0))
    throw new KvRejected('reserved KV state header bytes are not 0', 'malformed');
  if (!h.subarray(AT.fingerprint, AT.fingerprint + 32).equals(o.fingerprint))
    throw new KvRejected(
      `the KV state is from another model or llama.cpp build (fingerprint ${h.subarray(24, 30).toString('hex')}, ` +
        `this decode's ${o.fingerprint.subarray(0, 6).toString('hex')})`,
      'foreign-model',
    );
  if (!h.subarray(AT.binding, AT.binding + 32).equals(bindingDigest(o.binding)))
    throw new KvRejected(
      `the KV state in blocks [${o.binding.blockIds.slice(0, 8).join(',')}${o.binding.blockIds.length > 8 ? ',...' : ''}] ` +
        `was not made for request '${o.binding.requestId}' of ${o.binding.engineId}`,
      'wrong-request',
    );
  const fields = readFields(h);
  if (fields.promptTokens > o.maxTokens)
    throw new KvRejected(
      `a KV state of ${fields.promptTokens} tokens: this decode's context holds ${o.maxTokens}`,
      'oversized',
    );
  return fields;
}

/** Bytes [from, from+len) of the envelope, copied out of the blocks (into `out` when given: len bytes). */
function gather(view: (i: number) => Buffer, blockBytes: number, from: number, len: number, out?: Buffer): Buffer {
  out ??= Buffer.allocUnsafe(len);
  let done = 0;
  while (done < len) {
    const at = from + done;
    const off = at % blockBytes;
    const n = Math.min(len - done, blockBytes - off);
    view(Math.floor(at / blockBytes)).copy(out, done, off, off + n);
    done += n;
  }
  return out;
}

/** Writes src at envelope offset `from` across the blocks. */
function scatter(view: (i: number) => Buffer, blockBytes: number, from: number, src: Buffer): void {
  let done = 0;
  while (done < src.length) {
    const at = from + done;
    const off = at % blockBytes;
    const n = Math.min(src.length - done, blockBytes - off);
    src.copy(view(Math.floor(at / blockBytes)), off, done, done + n);
    done += n;
  }
}

/**
 * Test hook: ways a state can arrive damaged (each must be refused, nothing
 * loaded), or a function given the whole envelope (header and state) that
 * returns the bytes to put in its place (cut to the blocks it has).
 */
export type Tamper = 'truncate' | 'corrupt' | 'oversize' | 'foreign' | ((envelope: Buffer) => Buffer);

/** Damages the envelope in blocks 0..blocks-1 (a test hook of the prefill; it seals with `secret` as a prefill does). */
export function tamperEnvelope(
  view: (block: number, layer: number) => Buffer,
  blocks: number,
  blockBytes: number,
  how: Tamper,
  secret?: string,
): void {
  const v = (i: number) => view(i, 0);
  const room = blocks * blockBytes;
  const h = gather(v, blockBytes, 0, HEADER_BYTES);
  const stateBytes = Number(h.readBigUInt64LE(AT.stateBytes));
  const env = gather(v, blockBytes, 0, Math.min(room, HEADER_BYTES + stateBytes));
  let out = env;
  switch (how) {
    case 'corrupt':
      // One bit in the middle of the state.
      env[HEADER_BYTES + Math.floor(stateBytes / 2)] ^= 0x10;
      break;
    case 'truncate':
      // The state claims one block more than there are.
      env.writeBigUInt64LE(BigInt(room), AT.stateBytes);
      resealEnvelope(env, secret);
      break;
    case 'oversize':
      env.writeBigUInt64LE(1n << 40n, AT.stateBytes);
      resealEnvelope(env, secret);
      break;
    case 'foreign':
      env.fill(0x42, AT.fingerprint, AT.fingerprint + 32);
      resealEnvelope(env, secret);
      break;
    default:
      out = how(env);
  }
  scatter(v, blockBytes, 0, out.subarray(0, room));
}
