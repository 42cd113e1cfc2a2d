// Connecting to a remote engine, step by step, each step with the failure
// kind it stands for: 'handshake' when the side channel or what it answered
// is at fault, 'setup' when a bound on what the peer sizes or loading its
// agents fails. Both pull (decode reads) and push (prefill writes) connect
// this way: every rank the TP mapping names, nothing else.
import type { DlistHandle } from '../agent';
import { NixlError } from '../errors';
import type { NixlAgentMetadata } from '../handshake/model';
import type { FetchResult } from '../handshake/types';
import type { BlockSlices } from './descs';
import type { KvLayout } from './layout';
import { PROBE } from './lease-board';
import { checkRemoteCounts, type PullLimits } from './limits';
import { type RankRead, type ReadPlan, planReads } from './tp';

/** A remote engine to connect to: its side channel and engine id. */
export interface RemoteEndpoint {
  host: string;
  /** The prefill engine's advertised side-channel port (kv_transfer_params remote_port). */
  port: number;
  tpSize: number;
  /** Added to port for ZMQ (vLLM's remote_port already includes it: leave 0 then). */
  dpRank?: number;
  /** Pipeline ranks of the prefill engine. Default 1. */
  ppSize?: number;
  /** Default 1 (nixl-node does not read from DCP > 1). */
  dcpSize?: number;
  /** The engine id kv_transfer_params named: the metadata must carry it. */
  engineId?: string;
}

/** Which kind of connect step failed. @internal */
export type ConnectFailure = 'handshake' | 'setup';

/** The steps of one connect: what a step throws is recorded as its kind before it propagates. @internal */
export class ConnectSteps {
  /** The kind of the step that failed, once one did. */
  failedAs: ConnectFailure | undefined;

  run<T>(kind: ConnectFailure, f: () => T): T {
    try {
      const r = f();
      if (r instanceof Promise)
        return r.catch((e: unknown) => {
          this.failedAs = kind;
          throw e;
        }) as T;
      return r;
    } catch (e) {
      this.failedAs = kind;
      throw e;
    }
  }
}

/** One handshaked rank of a remote engine. @internal */
export interface RemoteRank {
  ppRank: number;
  rank: number;
  agentName: string;
  meta: NixlAgentMetadata;
  dlist: DlistHandle;
  /** Blocks per region of its prepped list. */
  counts: readonly number[];
  /** [address, slots] of its lease board (a nixl-node prefill): reads are confirmed against it. */
  board?: readonly bigint[];
}

/** One planned read with its block slices on both sides, fixed at connect time. @internal */
export interface PreparedRead {
  read: RankRead;
  rank: RemoteRank;
  local: BlockSlices;
  remote: BlockSlices;
  /** Bytes one block contributes (all regions). */
  blockBytes: number;
}

/** A connected remote engine: its ranks with their agents and prepared lists. @internal */
export interface RemoteEngine {
  key: string;
  engineId: string;
  /** The plan of pipeline rank 0 (all pipeline ranks map TP alike). */
  plan: ReadPlan;
  ranks: Map<string, RemoteRank>;
  reads: PreparedRead[];
  numBlocks: number;
  /** Kernel blocks per logical block on the prefill side. */
  physicalBlocksPerLogical: number;
  handshakeMs: number;
  /** v12: prefill clock - our clock, seconds, from the lowest-RTT handshake sample. */
  clockOffsetS: number | undefined;
  /** The lowest handshake round trip, ms: half of it bounds the clock offset's error. */
  bestRttMs: number;
  /** Its remote agents were removed and dlists released (once). */
  dropped: boolean;
  /** Pulls using it right now; a replaced engine is dropped when they end. */
  pulls: number;
  /** Set when a newer incarnation of the same prefill replaced it. */
  retired?: () => void;
  /** The remote agent of every rank. */
  agentNames(): string[];
}

/**
 * One cached connection per remote address *and* what the request says of
 * it: a request naming another tp_size or engine id handshakes afresh and is
 * checked against what answers, instead of reusing (and trusting) a plan made
 * for different parameters.
 * @internal
 */
export function engineKey(ep: RemoteEndpoint): string {
  return `${ep.host}:${ep.port}:${ep.dpRank ?? 0}|${ep.engineId ?? ''}|${ep.tpSize}x${ep.ppSize ?? 1}x${ep.dcpSize ?? 1}`;
}

type Target = { ppRank: number; tpRank: number };

/**
 * Fetches every target rank's metadata. The first rank alone first: its
 * metadata must fit the TP size the request names (block lengths follow from
 * the TP ratio) before we ask the others, since asking a vLLM prefill for a
 * rank it does not have kills its side-channel listener (a forged tp_size
 * would). Then the rest, at most handshakeConcurrency sockets open at once.
 * @internal
 */
export async function fetchRanks(
  steps: ConnectSteps,
  ep: RemoteEndpoint,
  layout: KvLayout,
  limits: Required<PullLimits>,
  targets: readonly Target[],
  fetch: (t: Target) => Promise<FetchResult>,
  geometry = true,
): Promise<FetchResult[]> {
  const head = await steps.run('handshake', () => fetch(targets[0]));
  steps.run('setup', () => checkRemoteCounts(head.metadata, limits));
  // A notif-only connect (push decode) checks no geometry, as vLLM's
  // _add_notif_only_remote_agent; it still asks only for ranks that exist.
  if (geometry)
    steps.run('handshake', () => {
      const ctx = (ep.ppSize ?? 1) > 1 ? { ppRank: 0, regionStart: 0, dcpSize: ep.dcpSize } : { dcpSize: ep.dcpSize };
      planReads(layout, ep.tpSize, head.metadata, ctx);
    });
  const rest = await steps.run('handshake', () => mapLimit(targets.slice(1), limits.handshakeConcurrency, fetch));
  const fetched = [head, ...rest];
  steps.run('setup', () => {
    for (const f of fetched) checkRemoteCounts(f.metadata, limits);
  });
  return fetched;
}

/** Every rank must agree with the request (and with each other) before anything is registered. @internal */
export function checkAgreement(ep: RemoteEndpoint, targets: readonly Target[], metas: NixlAgentMetadata[]): void {
  const first = metas[0];
  metas.forEach((m, i) => {
    if (ep.engineId !== undefined && m.engineId !== ep.engineId)
      throw new NixlError(
        `engine_id: remote (pp ${targets[i].ppRank}, tp ${targets[i].tpRank}) sent '${m.engineId}', kv_transfer_params named '${ep.engineId}'`,
        'NIXL_ERR_MISMATCH',
      );
    if (m.engineId !== first.engineId || m.numBlocks !== first.numBlocks)
      throw new NixlError(
        `remote ranks disagree on engine_id or num_blocks: ${first.engineId}/${first.numBlocks} vs ${m.engineId}/${m.numBlocks}`,
        'NIXL_ERR_MISMATCH',
      );
  });
}

/** The read plan of each pipeline rank (each holds its own regions, in order). @internal */
export function planPipeline(layout: KvLayout, ep: RemoteEndpoint, metas: NixlAgentMetadata[]): ReadPlan[] {
  const ppSize = ep.ppSize ?? 1;
  const plans: ReadPlan[] = [];
  const perPp = metas.length / ppSize;
  let regionStart = 0;
  for (let pp = 0; pp < ppSize; pp++) {
    const ctx = ppSize > 1 ? { ppRank: pp, regionStart, dcpSize: ep.dcpSize } : { dcpSize: ep.dcpSize };
    const own = metas.slice(pp * perPp, (pp + 1) * perPp);
    plans.push(planReads(layout, ep.tpSize, own[0], ctx));
    for (const m of own.slice(1)) planReads(layout, ep.tpSize, m, ctx);
    regionStart += own[0].kvCachesBaseAddr.length;
  }
  if (regionStart !== layout.baseAddrs.length)
    throw new NixlError(
      `kv_caches_base_addr (regions): the ${ppSize} pipeline ranks hold ${regionStart}, local ${layout.baseAddrs.length}`,
      'NIXL_ERR_MISMATCH',
    );
  return plans;
}

/** A new, not yet loaded engine from what its ranks answered. @internal */
export function newEngine(key: string, plan: ReadPlan, fetched: FetchResult[]): RemoteEngine {
  const first = fetched[0].metadata;
  // The clock offset of the sample with the lowest round trip (vLLM).
  let best: FetchResult | undefined;
  for (const f of fetched) if (f.clockOffsetS !== undefined && (!best || f.rttMs < best.rttMs)) best = f;
  const ranks = new Map<string, RemoteRank>();
  return {
    key,
    engineId: first.engineId,
    plan,
    ranks,
    reads: [],
    numBlocks: first.numBlocks,
    physicalBlocksPerLogical: first.physicalBlocksPerLogical,
    handshakeMs: 0,
    clockOffsetS: best?.clockOffsetS,
    bestRttMs: Math.min(...fetched.map((f) => f.rttMs)),
    dropped: false,
    pulls: 0,
    agentNames: () => [...ranks.values()].map((r) => r.agentName),
  };
}

/** A lease board a prefill's metadata names, if it is one we can read. @internal */
export function usableBoard(b: bigint[] | undefined): readonly bigint[] | undefined {
  if (b?.length !== 2) return undefined;
  return b[1] >= BigInt(PROBE) && b[1] <= 1n << 24n ? b : undefined;
}

/** fn over items with at most `limit` running at once; rejects on the first failure (starting no more). */
async function mapLimit<T, R>(items: readonly T[], limit: number, fn: (t: T) => Promise<R>): Promise<R[]> {
  const out = new Array<R>(items.length);
  let next = 0;
  let failed = false;
  const run = async () => {
    while (!failed && next < items.length) {
      const i = next++;
      try {
        out[i] = await fn(items[i]);
      } catch (e) {
        failed = true;
        throw e;
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, run));
  return out;
}
