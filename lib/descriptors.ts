// Memory descriptors as the addon takes them: one BigUint64Array of
// [addr, len, devId] triples per list, so a batch crosses into C++ in one call
// with no per-block conversion.
import { invalidParam } from './errors';
import { binding } from './native';

/** Where memory lives: host (DRAM), GPU (VRAM), block device, object store or file, as in NIXL. */
export type MemType = 'DRAM' | 'VRAM' | 'BLK' | 'OBJ' | 'FILE';
const MEM_TYPES: readonly MemType[] = ['DRAM', 'VRAM', 'BLK', 'OBJ', 'FILE'];

export function memTypeId(t: MemType): number {
  const i = MEM_TYPES.indexOf(t);
  if (i < 0) throw invalidParam(`unknown memory type '${String(t)}' (expected one of ${MEM_TYPES.join(', ')})`);
  return i;
}

/** Memory owned elsewhere (e.g. a CUDA allocation from another addon). */
export interface RawDesc {
  /** Start address. */
  addr: bigint;
  /** Length in bytes. */
  len: number | bigint;
  /** Device id (GPU index for VRAM); 0 by default. */
  devId?: number;
}

/** Memory a descriptor list can be made from: a buffer, a view, or a raw address range. */
export type MemoryLike = ArrayBufferView | ArrayBuffer | RawDesc;

function isRaw(m: unknown): m is RawDesc {
  return typeof m === 'object' && m !== null && typeof (m as RawDesc).addr === 'bigint';
}

/** A list of descriptors of one memory type (NIXL's nixlXferDList / nixlRegDList). */
export class DescList {
  readonly memType: MemType;
  /** [addr, len, devId] triples */
  readonly triples: BigUint64Array;
  /** JS memory the descriptors point into; registration keeps it alive. */
  readonly owners: readonly object[];

  constructor(triples: BigUint64Array, memType: MemType = 'DRAM', owners: readonly object[] = []) {
    if (triples.length % 3 !== 0) throw invalidParam('descriptor triples: length must be a multiple of 3');
    memTypeId(memType);
    this.triples = triples;
    this.memType = memType;
    this.owners = owners;
  }

  get length(): number {
    return this.triples.length / 3;
  }

  /** Start address of descriptor i. */
  addr(i: number): bigint {
    return this.triples[3 * i];
  }

  /** Length of descriptor i, bytes. */
  len(i: number): number {
    return Number(this.triples[3 * i + 1]);
  }

  /** Device id of descriptor i. */
  devId(i: number): number {
    return Number(this.triples[3 * i + 2]);
  }

  /** Buffers / typed arrays / ArrayBuffers / raw {addr, len, devId}. */
  static from(items: MemoryLike | readonly MemoryLike[], memType: MemType = 'DRAM'): DescList {
    const list = Array.isArray(items) ? (items as readonly MemoryLike[]) : [items as MemoryLike];
    const t = new BigUint64Array(list.length * 3);
    const owners: object[] = [];
    list.forEach((m, i) => {
      if (isRaw(m)) {
        const len = BigInt(m.len);
        if (len <= 0n) throw invalidParam(`descriptor ${i}: len must be > 0`);
        t[3 * i] = m.addr;
        t[3 * i + 1] = len;
        t[3 * i + 2] = BigInt(m.devId ?? 0);
      } else if (ArrayBuffer.isView(m) || m instanceof ArrayBuffer) {
        if (memType !== 'DRAM') throw invalidParam(`descriptor ${i}: a JS buffer is DRAM, not ${memType}`);
        if (m.byteLength === 0) throw invalidParam(`descriptor ${i}: empty buffer`);
        t[3 * i] = binding.addressOf(m);
        t[3 * i + 1] = BigInt(m.byteLength);
        t[3 * i + 2] = 0n;
        owners.push(m);
      } else {
        throw invalidParam(
          `descriptor ${i}: expected a Buffer, typed array, ArrayBuffer or {addr: bigint, len, devId}`,
        );
      }
    });
    return new DescList(t, memType, owners);
  }
}

export function toDescList(m: DescList | MemoryLike | readonly MemoryLike[], memType?: MemType): DescList {
  return m instanceof DescList ? m : DescList.from(m, memType ?? 'DRAM');
}

/**
 * Entry indices of a prepared list. Each number must be an integer in
 * [0, 2^32): Uint32Array.from would wrap or truncate the rest (2^32 + 1 -> 1,
 * 1.5 -> 1, NaN -> 0) and the request would silently move another block.
 */
export function toIndices(idx: Uint32Array | readonly number[]): Uint32Array {
  if (idx instanceof Uint32Array) return idx;
  // Anything else that has no list of entries (null, a number, a plain object)
  // would read as length 0 or fail without a code: an empty transfer that moves nothing.
  if (!Array.isArray(idx) && !(ArrayBuffer.isView(idx) && !(idx instanceof DataView)))
    throw invalidParam(
      `indices are ${idx === null ? 'null' : typeof idx}: give a Uint32Array or an array of integers from 0 to 2^32 - 1`,
    );
  const out = new Uint32Array(idx.length);
  for (let i = 0; i < idx.length; i++) {
    const v = idx[i];
    if (!Number.isInteger(v) || v < 0 || v > 0xffffffff)
      throw invalidParam(
        `index [${i}] is ${typeof v === 'number' ? v : typeof v}: indices are integers from 0 to 2^32 - 1`,
      );
    out[i] = v;
  }
  return out;
}

/** Page-aligned memory backed by a shared mapping that peers on this host can map directly. */
export function allocate(bytes: number): Buffer {
  return binding.allocate(bytes);
}
