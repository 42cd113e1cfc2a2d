// A msgpack writer with msgspec's encoding (smallest int/str/bin/array/map
// headers, map keys in field order, 64-bit addresses as uint64, floats only
// where a field is a float) and a strict reader, shared by both wire profiles.
import { HandshakeError } from './errors';

// ---- msgpack writer ---------------------------------------------------------

/** A msgpack float64 (msgspec encodes a Python float as 0xcb even when it is whole). */
export class Float64 {
  constructor(readonly value: number) {}
}

/** A msgpack value as the codec reads and writes it (64-bit integers as bigint, floats tagged). */
export type MpValue = string | number | bigint | boolean | null | Buffer | Float64 | MpValue[] | Map<string, MpValue>;

class Writer {
  #chunks: Buffer[] = [];

  head(small: number, base: number, codes: [number, number, number], n: number): void {
    if (n < small) this.#chunks.push(Buffer.from([base | n]));
    else this.sized(codes, n);
  }

  sized(codes: [number, number, number], n: number): void {
    let b: Buffer;
    if (n < 0x100 && codes[0] !== 0) {
      b = Buffer.from([codes[0], n]);
    } else if (n < 0x10000) {
      b = Buffer.alloc(3);
      b[0] = codes[1];
      b.writeUInt16BE(n, 1);
    } else {
      b = Buffer.alloc(5);
      b[0] = codes[2];
      b.writeUInt32BE(n, 1);
    }
    this.#chunks.push(b);
  }

  int(v: bigint): void {
    let b: Buffer;
    if (v >= 0n) {
      if (v < 0x80n) b = Buffer.from([Number(v)]);
      else if (v < 0x100n) b = Buffer.from([0xcc, Number(v)]);
      else if (v < 0x10000n) {
        b = Buffer.alloc(3);
        b[0] = 0xcd;
        b.writeUInt16BE(Number(v), 1);
      } else if (v < 0x100000000n) {
        b = Buffer.alloc(5);
        b[0] = 0xce;
        b.writeUInt32BE(Number(v), 1);
      } else if (v < 1n << 64n) {
        b = Buffer.alloc(9);
        b[0] = 0xcf;
        b.writeBigUInt64BE(v, 1);
      } else throw new HandshakeError(`integer ${v} does not fit in uint64`);
    } else {
      if (v >= -32n) b = Buffer.from([Number(v) & 0xff]);
      else if (v >= -0x80n) {
        b = Buffer.alloc(2);
        b[0] = 0xd0;
        b.writeInt8(Number(v), 1);
      } else if (v >= -0x8000n) {
        b = Buffer.alloc(3);
        b[0] = 0xd1;
        b.writeInt16BE(Number(v), 1);
      } else if (v >= -0x80000000n) {
        b = Buffer.alloc(5);
        b[0] = 0xd2;
        b.writeInt32BE(Number(v), 1);
      } else if (v >= -(1n << 63n)) {
        b = Buffer.alloc(9);
        b[0] = 0xd3;
        b.writeBigInt64BE(v, 1);
      } else throw new HandshakeError(`integer ${v} does not fit in int64`);
    }
    this.#chunks.push(b);
  }

  value(v: MpValue): void {
    if (v === null) this.#chunks.push(Buffer.from([0xc0]));
    else if (v === true || v === false) this.#chunks.push(Buffer.from([v ? 0xc3 : 0xc2]));
    else if (typeof v === 'bigint') this.int(v);
    else if (v instanceof Float64) {
      const b = Buffer.alloc(9);
      b[0] = 0xcb;
      b.writeDoubleBE(v.value, 1);
      this.#chunks.push(b);
    } else if (typeof v === 'number') {
      if (!Number.isSafeInteger(v))
        throw new HandshakeError(`${v} is not an integer the wire format can carry exactly`);
      this.int(BigInt(v));
    } else if (typeof v === 'string') {
      const s = Buffer.from(v, 'utf8');
      this.head(32, 0xa0, [0xd9, 0xda, 0xdb], s.length);
      this.#chunks.push(s);
    } else if (Buffer.isBuffer(v)) {
      this.sized([0xc4, 0xc5, 0xc6], v.length);
      this.#chunks.push(v);
    } else if (Array.isArray(v)) {
      this.head(16, 0x90, [0, 0xdc, 0xdd], v.length);
      for (const x of v) this.value(x);
    } else {
      this.head(16, 0x80, [0, 0xde, 0xdf], v.size);
      for (const [k, x] of v) {
        this.value(k);
        this.value(x);
      }
    }
  }

  done(): Buffer {
    return Buffer.concat(this.#chunks);
  }
}

/** msgpack of a value built from strings, ints (number/bigint), Buffers, arrays and Maps. */
export function packMsgpack(v: MpValue): Buffer {
  const w = new Writer();
  w.value(v);
  return w.done();
}

// ---- msgpack reader ---------------------------------------------------------
// Our own, not msgpackr: msgspec's typed decoder tells an int from a float
// (1 vs 1.0) and str from bin, and refuses trailing bytes; msgpackr turns
// 1.0 into 1, so a float where vLLM sends an int would pass unnoticed.
// Ints come back as numbers when exact, else as bigints (int64/uint64
// range); floats as Float64; maps as null-prototype objects with string keys.

const MAX_DEPTH = 32;

class Reader {
  #p = 0;
  constructor(private readonly b: Buffer) {}

  #need(n: number): void {
    if (this.#p + n > this.b.length) throw new Error(`truncated at byte ${this.#p}`);
  }

  #u8(): number {
    this.#need(1);
    return this.b[this.#p++];
  }

  #bytes(n: number): Buffer {
    this.#need(n);
    const out = this.b.subarray(this.#p, this.#p + n);
    this.#p += n;
    return out;
  }

  #uint(size: 1 | 2 | 4): number {
    this.#need(size);
    const v = size === 1 ? this.b[this.#p] : size === 2 ? this.b.readUInt16BE(this.#p) : this.b.readUInt32BE(this.#p);
    this.#p += size;
    return v;
  }

  #int(v: bigint): number | bigint {
    return v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
  }

  #str(n: number): string {
    const s = this.#bytes(n);
    const t = s.toString('utf8');
    if (!Buffer.from(t, 'utf8').equals(s)) throw new Error('a str that is not valid UTF-8');
    return t;
  }

  #array(n: number, depth: number): unknown[] {
    if (n > this.b.length - this.#p) throw new Error(`array of ${n} elements in ${this.b.length - this.#p} bytes`);
    const out: unknown[] = [];
    for (let i = 0; i < n; i++) out.push(this.value(depth + 1));
    return out;
  }

  #map(n: number, depth: number): Record<string, unknown> {
    if (n > this.b.length - this.#p) throw new Error(`map of ${n} entries in ${this.b.length - this.#p} bytes`);
    const out: Record<string, unknown> = Object.create(null);
    for (let i = 0; i < n; i++) {
      const k = this.value(depth + 1);
      if (typeof k !== 'string') throw new Error('a map key that is not a str');
      out[k] = this.value(depth + 1);
    }
    return out;
  }

  value(depth = 0): unknown {
    if (depth > MAX_DEPTH) throw new Error(`nested deeper than ${MAX_DEPTH}`);
    const c = this.#u8();
    if (c <= 0x7f) return c;
    if (c >= 0xe0) return c - 0x100;
    if ((c & 0xf0) === 0x80) return this.#map(c & 0x0f, depth);
    if ((c & 0xf0) === 0x90) return this.#array(c & 0x0f, depth);
    if ((c & 0xe0) === 0xa0) return this.#str(c & 0x1f);
    switch (c) {
      case 0xc0:
        return null;
      case 0xc2:
        return false;
      case 0xc3:
        return true;
      case 0xc4:
        return Buffer.from(this.#bytes(this.#uint(1)));
      case 0xc5:
        return Buffer.from(this.#bytes(this.#uint(2)));
      case 0xc6:
        return Buffer.from(this.#bytes(this.#uint(4)));
      case 0xca:
        this.#need(4);
        this.#p += 4;
        return new Float64(this.b.readFloatBE(this.#p - 4));
      case 0xcb:
        this.#need(8);
        this.#p += 8;
        return new Float64(this.b.readDoubleBE(this.#p - 8));
      case 0xcc:
        return this.#uint(1);
      case 0xcd:
        return this.#uint(2);
      case 0xce:
        return this.#uint(4);
      case 0xcf:
        this.#need(8);
        this.#p += 8;
        return this.#int(this.b.readBigUInt64BE(this.#p - 8));
      case 0xd0:
        this.#need(1);
        return this.b.readInt8(this.#p++);
      case 0xd1:
        this.#need(2);
        this.#p += 2;
        return this.b.readInt16BE(this.#p - 2);
      case 0xd2:
        this.#need(4);
        this.#p += 4;
        return this.b.readInt32BE(this.#p - 4);
      case 0xd3:
        this.#need(8);
        this.#p += 8;
        return this.#int(this.b.readBigInt64BE(this.#p - 8));
      case 0xd9:
        return this.#str(this.#uint(1));
      case 0xda:
        return this.#str(this.#uint(2));
      case 0xdb:
        return this.#str(this.#uint(4));
      case 0xdc:
        return this.#array(this.#uint(2), depth);
      case 0xdd:
        return this.#array(this.#uint(4), depth);
      case 0xde:
        return this.#map(this.#uint(2), depth);
      case 0xdf:
        return this.#map(this.#uint(4), depth);
      default:
        throw new Error(`type byte 0x${c.toString(16)} (ext types are not part of this format)`);
    }
  }

  end(): void {
    if (this.#p !== this.b.length) throw new Error(`${this.b.length - this.#p} trailing bytes`);
  }
}

/** Decodes one msgpack value; `what` names it in errors. Integers >= 2^64 are refused. */
export function unpackMsgpack(buf: Uint8Array, what: string): unknown {
  const r = new Reader(Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength));
  try {
    const v = r.value();
    r.end();
    return v;
  } catch (e) {
    throw new HandshakeError(`${what}: not valid msgpack (${(e as Error).message})`, 'NIXL_ERR_INVALID_PARAM', {
      cause: e,
    });
  }
}
