// What the side-channel tests against hostile peers and the garbage collector
// share: a bound on how long a promise may take, and a one-rank payload.
import { encodeAgentMetadata } from '../../lib/handshake';

/** Settles `p`, or rejects naming `what` after `ms` (so a hang fails here, not at the test timeout). */
export function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let t: NodeJS.Timeout | undefined;
  const bound = new Promise<never>((_, reject) => {
    t = setTimeout(() => reject(new Error(`${what}: nothing settled in ${ms} ms`)), ms);
  });
  return Promise.race([p, bound]).finally(() => clearTimeout(t));
}

/** Rank 0's payload (v12 profile), its agent metadata the bytes 'md'. */
export function rankZeroPayload() {
  return new Map([
    [
      0,
      {
        compatibilityHash: 'a'.repeat(64),
        agentMetadataBytes: encodeAgentMetadata(
          {
            engineId: 'engine-P',
            agentMetadata: Buffer.from('md'),
            kvCachesBaseAddr: [0x7f3a00000000n],
            deviceId: 0,
            numBlocks: 8,
            blockLens: [4096],
            kvCacheLayout: 'LBHNC',
            blockSize: 16,
            attnBackendName: 'FLASH_ATTN',
          },
          'v12',
        ),
      },
    ],
  ]);
}
