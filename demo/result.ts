// What `nixl-node demo --json FILE` writes: what ran (the geometry and every
// request's block ids, so another program can run exactly the same pulls)
// and what was measured. The bench's demo row reads it from a child process.
import * as fs from 'node:fs';
import type { DemoRequest } from './decode-worker';
import type { RoundSummary } from './report';

/** The demo's KV geometry as it ran. */
export interface DemoGeometry {
  prefillTp: number;
  decodeTp: number;
  layers: number;
  /** Regions per rank: layers x 2 (K, V), or layers with MLA. */
  regions: number;
  /** Blocks per rank and region. */
  blocks: number;
  heads: number;
  mla: boolean;
  blockKib: number;
  /** Bytes of one block of one region on a prefill rank, and on a decode rank. */
  prefillBlockBytes: number;
  decodeBlockBytes: number;
  requests: number;
  blocksPerRequest: number;
  inFlight: number;
  rounds: number;
}

/** The C++ program on the same NIXL (nixl engine only). */
export type NativeBaseline =
  | { gbps: number; gbpsMin: number; gbpsMax: number; blockBytes: number; blocks: number }
  | { skip: string }
  | { error: string };

export interface DemoResult {
  ok: boolean;
  failures: string[];
  engine: 'loopback' | 'nixl';
  method: 'zmq' | 'http';
  /** Which agents ran NIXL's own progress thread: 'prefill', 'both' or 'none'. */
  progressThread: 'prefill' | 'both' | 'none';
  geometry: DemoGeometry;
  /** Per round, the requests every decode rank pulled (local and remote block ids). */
  plan: DemoRequest[][];
  /** Per decode rank. */
  handshakeMs: number[];
  bytes: number;
  descriptors: number;
  /** Head rows that did not hold the bytes they should (0: every byte verified). */
  badRows: number;
  released: number;
  expired: number;
  /** One-thread memcpy of this run, GB/s. */
  memcpyGbps: number;
  rounds: RoundSummary[];
  /** GB/s of round 1 (first touch), and the median and range of the later rounds (null with one round). */
  firstGbps: number;
  laterGbps: { median: number; min: number; max: number } | null;
  native?: NativeBaseline;
}

export function writeDemoResult(file: string, r: DemoResult): void {
  fs.writeFileSync(file, `${JSON.stringify(r, null, 2)}\n`);
}
