// What a worker is made of, made from its options and its model: the agent,
// the registered blocks, the hold table, the KV mode (pull or push, picked
// here once), bidirectional KV's turns and the metrics. The roles are given
// these parts; the worker wires them to its fronts.
import { NixlAgent } from '../../agent';
import { DEFAULT_TURN_TTL_MS } from '../../kv/turn-params';
import type { ServingModel } from '../models/types';
import { BlockStore } from './block-store';
import type { WorkerParts } from './context';
import type { HandoffOptions } from './handoff';
import { PullHandoff } from './handoff-pull';
import { handoffFor } from './handoff-push';
import { HoldTable } from './holds';
import { type WorkerOptions, kvSecret } from './options';
import { newStats } from './stats';
import { DEFAULT_REUSE_HANDSHAKE_MS, TurnKv } from './turns';
import { WorkerMetrics } from './vllm-metrics';
import { KvPeers } from '../../kv/peers';

/** A worker's parts, and what only the worker itself uses of them. */
export interface Wired extends WorkerParts {
  readonly agent: NixlAgent;
  /** GET /metrics; undefined without prom-client. */
  readonly metrics?: WorkerMetrics;
}

/** The parts of worker `name`; `active`: its requests in progress (a gauge of the metrics). */
export function makeParts(o: WorkerOptions, model: ServingModel, name: string, active: () => number): Wired {
  const hooks = o.testHooks ?? {};
  const stats = newStats();
  const agent = new NixlAgent(name, { engine: o.engine });
  const blocks = new BlockStore(agent, model.geometry, o.blocks ?? 512, o);
  const holds = new HoldTable({ stats, blocks, poisonFreed: hooks.poisonFreed });
  const secret = kvSecret(o);
  const skew = hooks.clockSkewMs ?? 0;
  const layout = blocks.layout(name);
  const h: HandoffOptions = {
    name,
    agent,
    layout,
    peers: new KvPeers({ agent, layout, wire: o.wire }),
    model,
    stats,
    wire: o.wire,
    leaseMs: o.leaseMs,
    secret,
    // This worker's monotonic clock, ms (skewed by the test hook).
    now: () => performance.now() + skew,
    hooks,
    pushTimeoutMs: o.pushTimeoutMs,
  };
  const handoff = handoffFor(o.kvMode, h, new PullHandoff(h));
  const { puller, tracker } = handoff.pull;
  const servedModelNames = o.servedModelNames?.length ? o.servedModelNames : [model.id];
  const modelId = servedModelNames[0];
  const share = o.heldTurnsShare ?? 0.5; // checked at start
  const turns = o.bidirectionalKv
    ? new TurnKv({
        name,
        wire: o.wire,
        secret,
        model,
        blocks,
        holds,
        pull: handoff.pull,
        ttlMs: o.decoderKvTtlMs ?? DEFAULT_TURN_TTL_MS,
        maxHeldBlocks: Math.floor(share * blocks.size),
        recomputeThreshold: o.kvRecomputeThreshold,
        reuseHandshakeMs: o.kvReuseHandshakeMs ?? DEFAULT_REUSE_HANDSHAKE_MS,
        tamperKv: hooks.tamperKv,
      })
    : undefined;
  return {
    name,
    model,
    stats,
    blocks,
    holds,
    handoff,
    turns,
    secret,
    hooks,
    servedModelNames,
    modelId,
    agent,
    metrics: WorkerMetrics.create(modelId, puller, tracker, blocks, stats, active),
  };
}
