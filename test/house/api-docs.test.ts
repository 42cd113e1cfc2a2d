// The API reference: TypeDoc over the public entry points (lib/index.ts and the
// subpaths' lib/handshake, lib/kv, lib/serving) with its
// validation on (typedoc.json: every exported symbol documented, no broken
// link, nothing referenced that is not exported) and warnings as errors, as
// `npm run docs` builds it.
import { spawnSync } from 'node:child_process';
import * as path from 'node:path';
import { expect, it } from 'vitest';

const ROOT = path.join(__dirname, '..', '..');

it('npm run docs: TypeDoc validates the public API with no warning', () => {
  const r = spawnSync(process.execPath, [path.join(ROOT, 'node_modules/typedoc/bin/typedoc'), '--emit', 'none'], {
    cwd: ROOT,
    encoding: 'utf8',
  });
  expect(`${r.stdout}${r.stderr}`).not.toMatch(/warning|error/i);
  expect(r.status).toBe(0);
}, 120_000);

// The runtime names of each entry point, in full: a name joins the public API
// on purpose (and the reference documents it), never by a wildcard export.
const PUBLIC: Record<string, string[]> = {
  '.': [
    'DescList',
    'DlistHandle',
    'KvPuller',
    'KvPushReceiver',
    'KvPushSender',
    'LayeredXferHandle',
    'NixlAgent',
    'NixlError',
    'PrefillTracker',
    'PullError',
    'PushError',
    'RegisteredMemory',
    'ServingProxy',
    'Status',
    'TransferModeError',
    'Worker',
    'XferHandle',
    'allocate',
    'buildKvTransferParams',
    'computeCompatibilityHash',
    'contextFromTraceparent',
    'createHandshake',
    'engines',
    'parseKvTransferParams',
    'planReads',
    'prefillRequestParams',
    'registerKvMetrics',
    'servePrefill',
    'setTracing',
    'startProxy',
    'startSpan',
    'startWorker',
    'targetRemoteRanks',
    'tpRatio',
    'wireProfile',
  ],
  handshake: [
    'DEFAULT_WIRE',
    'HTTP_SCHEMA',
    'HandshakeError',
    'HttpHandshake',
    'KV_LAYOUTS',
    'TransferModeError',
    'WIRE_PROFILES',
    'agentMetadataFromJson',
    'agentMetadataToJson',
    'buildKvTransferParams',
    'computeCompatibilityHash',
    'createHandshake',
    'decodeAgentMetadata',
    'encodeAgentMetadata',
    'parseKvTransferParams',
    'prefillRequestParams',
    'wireProfile',
    'wireV013',
    'wireV12',
    'zmqHandshake',
  ],
  kv: [
    'BUCKETS_MS',
    'DEFAULT_LIMITS',
    'DEFAULT_RECOMPUTE_THRESHOLD',
    'DEFAULT_TURN_TTL_MS',
    'KvLayoutError',
    'KvPeers',
    'KvPuller',
    'KvPushReceiver',
    'KvPushSender',
    'KvStats',
    'LeaseBoard',
    'PREFIX_DIGEST_KEY',
    'PREFIX_TOKENS_KEY',
    'PrefillTracker',
    'PullError',
    'PushError',
    'SIGNATURE_KEY',
    'SlotState',
    'checkLayout',
    'consumersPerProducer',
    'expand',
    'expectedConsumers',
    'isKvReplicated',
    'layoutOf',
    'namesPreviousTurn',
    'planReads',
    'planReuse',
    'registerKvMetrics',
    'replicatesKvCache',
    'servePrefill',
    'signKvTransferParams',
    'targetRemoteRanks',
    'toAgentMetadata',
    'tokensDigest',
    'tpRatio',
    'turnParams',
    'verifyKvTransferParams',
  ],
  serving: [
    'CONVERSATION_KEY',
    'FleetDiscovery',
    'FleetRegistration',
    'HttpError',
    'KvRejected',
    'LlamaModel',
    'ModelRequestError',
    'NODE_LLAMA_CPP',
    'ServingProxy',
    'SyntheticModel',
    'TurnKv',
    'Worker',
    'affinityKey',
    'joinFleet',
    'pickByLoad',
    'startProxy',
    'startWorker',
  ],
};

it('each entry point exports exactly its curated names, none of the codec internals', () => {
  for (const [entry, names] of Object.entries(PUBLIC)) {
    const m = require(path.join(ROOT, 'dist', 'lib', entry === '.' ? '' : entry));
    expect(Object.keys(m).sort(), entry).toEqual(names);
  }
  const all = Object.values(PUBLIC).flat();
  for (const internal of [
    'packMsgpack',
    'unpackMsgpack',
    'encodeFields',
    'pyJsonDumps',
    'readReply',
    'coalescedDescs',
    'HttpTransport',
    'ZmqTransport',
    'encodeMessage',
    'decodeMessage',
    'encodePushReg',
    'decodePushReg',
    'writeNotif',
    'kv',
    'handshake',
    'serving',
  ])
    expect(all).not.toContain(internal);
});
