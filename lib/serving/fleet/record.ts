// What a worker publishes about itself under its etcd key, and the strict
// reading of it: etcd is shared, so a value may be anything (another tool's,
// truncated, huge, hostile); a value that is not a well-formed record is
// ignored, never trusted in part.

/** A worker's role in a fleet: the proxy's pools it joins. */
export type FleetRole = 'prefill' | 'decode' | 'both' | 'encode';
export const FLEET_ROLES: readonly FleetRole[] = ['prefill', 'decode', 'both', 'encode'];

/** One worker as etcd holds it (JSON). */
export interface WorkerRecord {
  /** Format version: 1. */
  v: 1;
  name: string;
  role: FleetRole;
  model: string;
  /**
   * Every name it serves (vLLM --served-model-name), model first; absent when
   * it has no aliases, or when they would not fit the record (its /health
   * still lists them).
   */
  servedModelNames?: string[];
  /** HTTP base URL, or ZeroMQ address. */
  address: string;
  transport: 'http' | 'zmq';
  /** KV blocks free and in all, when it last reported. */
  freeBlocks: number;
  totalBlocks: number;
  /** Requests in progress (prefills, decodes, held KV not yet read). */
  load: number;
  /** Where it publishes vLLM's KV events, when it does (docs/kv-events.md). */
  kv_events?: RecordKvEvents;
}

/** A worker's KV events: its PUB and replay addresses, topic, and the block size it announces. */
export interface RecordKvEvents {
  endpoint: string;
  replay_endpoint: string | null;
  topic: string;
  block_size?: number;
}

/** The kv_events field (of a record or a /health answer), or why it is not one. */
export function parseKvEvents(x: unknown): RecordKvEvents | string {
  if (typeof x !== 'object' || x === null || Array.isArray(x)) return "'kv_events' is not an object";
  const k = x as Record<string, unknown>;
  const zmqAddr = (a: unknown) => isText(a, 512) && /^(tcp|ipc):\/\/\S+$/.test(a);
  if (!zmqAddr(k.endpoint)) return "'kv_events.endpoint' is not a ZeroMQ address";
  if (k.replay_endpoint !== null && !zmqAddr(k.replay_endpoint))
    return "'kv_events.replay_endpoint' is not a ZeroMQ address or null";
  if (typeof k.topic !== 'string' || k.topic.length > 512) return "'kv_events.topic' is not a string";
  if (k.block_size !== undefined && !(isCount(k.block_size) && k.block_size > 0))
    return "'kv_events.block_size' is not a count";
  return {
    endpoint: k.endpoint as string,
    replay_endpoint: k.replay_endpoint as string | null,
    topic: k.topic,
    ...(k.block_size !== undefined ? { block_size: k.block_size as number } : {}),
  };
}

/** The largest value a proxy reads; anything longer is ignored unread. */
export const MAX_RECORD_BYTES = 4096;
const MAX_COUNT = 2 ** 31;
/** Served names a record lists at most. */
const MAX_NAMES = 32;
/** What the names may take of a record, bytes: the rest of it stays well under MAX_RECORD_BYTES. */
const MAX_NAMES_BYTES = 2048;

/**
 * The record's servedModelNames field: the names when there are aliases and
 * they fit (at most MAX_NAMES printable ones, MAX_NAMES_BYTES in all), else
 * nothing (a proxy then learns them from the worker's /health).
 */
export function servedNamesField(names: readonly string[] | undefined): { servedModelNames?: string[] } {
  if (!names || names.length < 2 || names.length > MAX_NAMES || !names.every((n) => isText(n, 256))) return {};
  return Buffer.byteLength(JSON.stringify(names)) > MAX_NAMES_BYTES ? {} : { servedModelNames: [...names] };
}

function isCount(x: unknown): x is number {
  return typeof x === 'number' && Number.isInteger(x) && x >= 0 && x < MAX_COUNT;
}

function isText(x: unknown, max: number): x is string {
  // Printable ASCII only: it ends up in logs, metrics labels and URLs.
  return typeof x === 'string' && x.length > 0 && x.length <= max && /^[\x21-\x7e]+$/.test(x);
}

/** Whether an address fits the transport: http(s)://host:port for HTTP, tcp:// or ipc:// for ZeroMQ. */
function isAddress(address: string, transport: 'http' | 'zmq'): boolean {
  if (transport === 'zmq') return /^(tcp:\/\/[^/]+:\d{1,5}|ipc:\/\/\S+)$/.test(address);
  try {
    const u = new URL(address);
    return (
      (u.protocol === 'http:' || u.protocol === 'https:') && u.host !== '' && (u.pathname === '/' || u.pathname === '')
    );
  } catch {
    return false;
  }
}

/** Serializes a record for etcd. */
export function encodeRecord(r: WorkerRecord): string {
  return JSON.stringify(r);
}

/** A record, or why the value is not one. */
export function parseRecord(value: Buffer | string): WorkerRecord | string {
  const size = typeof value === 'string' ? Buffer.byteLength(value) : value.length;
  if (size > MAX_RECORD_BYTES) return `${size} bytes, more than ${MAX_RECORD_BYTES}`;
  let o: unknown;
  try {
    o = JSON.parse(value.toString());
  } catch {
    return 'not JSON';
  }
  if (typeof o !== 'object' || o === null || Array.isArray(o)) return 'not a JSON object';
  const r = o as Record<string, unknown>;
  if (r.v !== 1) return `format version ${JSON.stringify(r.v)?.slice(0, 20)}, not 1`;
  if (!isText(r.name, 128)) return "'name' is not a short printable string";
  if (!FLEET_ROLES.includes(r.role as FleetRole)) return `'role' is not one of ${FLEET_ROLES.join(', ')}`;
  if (!isText(r.model, 256)) return "'model' is not a short printable string";
  const names = r.servedModelNames;
  if (names !== undefined && !(Array.isArray(names) && names.length <= MAX_NAMES && names.every((n) => isText(n, 256))))
    return `'servedModelNames' is not a list of at most ${MAX_NAMES} short printable strings`;
  if (r.transport !== 'http' && r.transport !== 'zmq') return "'transport' is not http or zmq";
  if (!isText(r.address, 512) || !isAddress(r.address, r.transport)) return `'address' is not a ${r.transport} address`;
  for (const k of ['freeBlocks', 'totalBlocks', 'load'] as const) if (!isCount(r[k])) return `'${k}' is not a count`;
  if ((r.freeBlocks as number) > (r.totalBlocks as number)) return "'freeBlocks' is more than 'totalBlocks'";
  const kvEvents = r.kv_events === undefined ? undefined : parseKvEvents(r.kv_events);
  if (typeof kvEvents === 'string') return kvEvents;
  return {
    v: 1,
    name: r.name,
    role: r.role as FleetRole,
    model: r.model,
    ...(names === undefined ? {} : { servedModelNames: names as string[] }),
    address: r.address.replace(/\/+$/, ''),
    transport: r.transport,
    freeBlocks: r.freeBlocks as number,
    totalBlocks: r.totalBlocks as number,
    load: r.load as number,
    ...(kvEvents ? { kv_events: kvEvents } : {}),
  };
}
