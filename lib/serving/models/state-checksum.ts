// The checksum of a KV state envelope without a KV secret: XXH64 (xxhash-wasm).
// Without a secret the MAC field only proves the bytes arrived as written
// (anyone can recompute any unkeyed hash), so it needs no cryptographic
// hash: SHA-256 took ~5 ms for a 10 MiB state, twice per hit (the prefill's
// seal, the decode's check); XXH64 takes under 1 ms, with 64 bits against
// accidental damage. With a secret the envelope keeps its HMAC-SHA256.
//
// xxhash-wasm compiles its module asynchronously: `stateChecksumReady()`
// starts it (a model's load awaits it); sealing or checking before it
// resolved is an error, never a silent fall back to another hash.
import xxhash from 'xxhash-wasm';
import { NixlError } from '../../errors';

type Api = Awaited<ReturnType<typeof xxhash>>;
/** The most of a state the hash reads at once (see stateChecksum). */
const SLICE_BYTES = 1 << 20;
let api: Api | undefined;
let loading: Promise<void> | undefined;

/** Loads the checksum's module once; later calls return the same promise. */
export function stateChecksumReady(): Promise<void> {
  loading ??= xxhash().then(
    (a) => {
      api = a;
    },
    (e: unknown) => {
      // No WebAssembly (node --jitless): a GGUF model cannot seal or check states.
      throw new NixlError(
        `the KV state checksum (xxhash-wasm) cannot load: ${(e as Error)?.message ?? e}`,
        'NIXL_ERR_NOT_SUPPORTED',
        undefined,
        { cause: e },
      );
    },
  );
  return loading;
}

/** XXH64 (seed 0) of the parts one after the other, 8 bytes little-endian. */
export function stateChecksum(parts: readonly Uint8Array[]): Buffer {
  if (api === undefined)
    throw new NixlError(
      'the KV state checksum is not loaded yet (await stateChecksumReady())',
      'NIXL_ERR_NOT_SUPPORTED',
    );
  const h = api.create64();
  // In slices: xxhash-wasm copies each input into its own memory, which grows
  // to fit and never shrinks, so one whole state would stay resident for good.
  for (const p of parts) for (let at = 0; at < p.length; at += SLICE_BYTES) h.update(p.subarray(at, at + SLICE_BYTES));
  const out = Buffer.allocUnsafe(8);
  out.writeBigUInt64LE(h.digest());
  return out;
}

// Started on import, so that it is ready by the first state; a failure is
// reported to whoever awaits it (a model's load), never as an unhandled
// rejection that would end a process that needs no GGUF model.
stateChecksumReady().catch(() => {});
