// nixl-node/kv: the KV-cache path of disaggregated serving: the decode's
// puller, the prefill's server and tracker, TP mapping, layouts, leases,
// signed kv_transfer_params, counters and metrics. Descriptor planning, the
// pull's stages and its connections, and push's notification wire
// (PUSH_REG, write notifications, the quarantine) stay internal.
export { type KvLayout, type RemoteRankInfo, checkLayout, layoutOf, toAgentMetadata } from './layout';
export {
  KvLayoutError,
  type PlanContext,
  type RankRead,
  type ReadPlan,
  consumersPerProducer,
  expectedConsumers,
  isKvReplicated,
  planReads,
  replicatesKvCache,
  targetRemoteRanks,
  tpRatio,
} from './tp';
export type { HandshakeBudget } from './connect-wait';
export { KvPeers, type KvPeersOptions } from './peers';
export { BUCKETS_MS, KvStats, type KvStatsSink, type KvStatsSnapshot } from './stats';
export {
  KvPuller,
  type KvPullerOptions,
  PullError,
  type PullFailure,
  type PullFromParamsOptions,
  type PullOptions,
  type PullResult,
  type RemoteEndpoint,
  type RemoteLease,
  expand,
} from './pull/puller';
export {
  PrefillTracker,
  type PrefillRank,
  type PrefillTrackerOptions,
  type PrefillTrackerSink,
  type HoldOptions,
  type Released,
  type ServePrefillOptions,
  servePrefill,
} from './prefill';
export { type KvMetricsOptions, type PromRegistry, registerKvMetrics } from './metrics';
export { DEFAULT_LIMITS, type PullLimits } from './limits';
export { LeaseBoard, SlotState } from './lease-board';
export { SIGNATURE_KEY, signKvTransferParams, verifyKvTransferParams } from './params-auth';
export { KvPushReceiver, type KvPushReceiverOptions } from './push/decode';
export { KvPushSender, type KvPushSenderOptions, type PushSenderStats, type PushSent } from './push/prefill';
export { PushError, type PushFailure, type PushReceived, type ReceiveOptions } from './push/types';
// Types only: a receiver's quarantine and a push's params are readable; their
// wire (PUSH_REG, write notifications) is not a user's to compose.
export type { BlockQuarantine, Quarantined } from './push/quarantine';
export type { PushParams, PushRegLimits } from './push/reg';
export {
  DEFAULT_RECOMPUTE_THRESHOLD,
  DEFAULT_TURN_TTL_MS,
  PREFIX_DIGEST_KEY,
  PREFIX_TOKENS_KEY,
  type ReusePlan,
  type ReuseRules,
  namesPreviousTurn,
  planReuse,
  tokensDigest,
  turnParams,
} from './turn-params';
