// Push mode's wire (vLLM's NixlPushConnector; ../shared/specs/vllm-nixl-push.md):
//   PUSH_REG  b"PUSH_REG:" + msgpack map, decode -> every prefill agent it
//             handshaked (notif-only): which of the decode's blocks to fill
//   WRITE     notif "<decode request id>:<prefill TP size>" on each WRITE
//   params    what a decode is given to wait for a push (remote_* of the
//             prefill, tp_size and pp_size)
// The map is vLLM's, keys in its order; nixl-node adds two keys vLLM's
// prefill ignores (it decodes untyped and reads by name): nixl_node_confirm
// (a nixl-node decode wants the completion notification only after the
// prefill confirmed it held its blocks for the whole WRITE) and, with a KV
// secret, nixl_node_signature. Decoding refuses anything malformed, forged
// or oversized with a NixlError before a single field is used.
import { createHmac, timingSafeEqual } from 'node:crypto';
import { NixlError } from '../../errors';
import { type MpValue, packMsgpack, unpackMsgpack } from '../../handshake/msgpack';
import type { WireName, WireProfile } from '../../handshake/model';
import { TransferModeError, wireProfile } from '../../handshake/wire';
import { showValue as show } from '../../show-value';

/** The 9 bytes a registration notification starts with. */
export const PUSH_REG_PREFIX = Buffer.from('PUSH_REG:');
/** The key a registration's signature travels under (with a KV secret). */
export const PUSH_REG_SIGNATURE_KEY = 'nixl_node_signature';

/** A decode's registration of its blocks with a prefill (vLLM's PUSH_REG map). */
export interface PushRegistration {
  /** The decode's own request id: the WRITE notifications carry it. */
  requestId: string;
  decodeEngineId: string;
  /** The decode's side channel (the prefill handshakes back to it). */
  decodeHost: string;
  decodePort: number;
  decodeTpSize: number;
  /** The decode's logical block ids per KV-cache group (only the blocks it lacks). */
  localBlockIds: number[][];
  /** The prefill engine the decode means. */
  remoteEngineId: string;
  remoteHost: string;
  remotePort: number;
  remoteTpSize: number;
  remotePpSize: number;
  /** nixl-node decodes: notify only after the prefill confirmed its blocks were held through the WRITE. */
  confirm?: boolean;
  /** nixl-node decodes: ms left before the decode gives up; a nixl-node prefill posts no WRITE after. */
  deadlineMs?: number;
  /** nixl-node decodes: wall-clock send time (Date.now()); signed, so a prefill can refuse a replay. */
  sentAtMs?: number;
}

/** Bounds on a registration a prefill accepts. */
export interface PushRegLimits {
  /** Largest notification, bytes. Default 1 MiB. */
  maxBytes?: number;
  /** Largest number of block ids in all groups. Default 1 << 20. */
  maxBlocks?: number;
  /** Largest number of KV-cache groups. Default 16. */
  maxGroups?: number;
}

const DEFAULT_REG_LIMITS: Required<PushRegLimits> = { maxBytes: 1 << 20, maxBlocks: 1 << 20, maxGroups: 16 };

const bad = (m: string) => new NixlError(`PUSH_REG: ${m}`, 'NIXL_ERR_INVALID_PARAM');

/** vLLM's map, in its key order (then nixl-node's keys). */
function toMap(r: PushRegistration): Map<string, MpValue> {
  const m = new Map<string, MpValue>([
    ['request_id', r.requestId],
    ['decode_engine_id', r.decodeEngineId],
    ['decode_host', r.decodeHost],
    ['decode_port', r.decodePort],
    ['decode_tp_size', r.decodeTpSize],
    ['local_block_ids', r.localBlockIds.map((g) => [...g])],
    ['remote_engine_id', r.remoteEngineId],
    ['remote_host', r.remoteHost],
    ['remote_port', r.remotePort],
    ['remote_tp_size', r.remoteTpSize],
    ['remote_pp_size', r.remotePpSize],
  ]);
  if (r.confirm) m.set('nixl_node_confirm', true);
  if (r.deadlineMs !== undefined) m.set('nixl_node_deadline_ms', r.deadlineMs);
  if (r.sentAtMs !== undefined) m.set('nixl_node_sent_at_ms', r.sentAtMs);
  return m;
}

function mac(r: PushRegistration, secret: string | Buffer): Buffer {
  const body = JSON.stringify([
    r.requestId,
    r.decodeEngineId,
    r.decodeHost,
    r.decodePort,
    r.decodeTpSize,
    r.localBlockIds,
    r.remoteEngineId,
    r.remoteHost,
    r.remotePort,
    r.remoteTpSize,
    r.remotePpSize,
    r.confirm === true,
    r.deadlineMs ?? null,
    r.sentAtMs ?? null,
  ]);
  return createHmac('sha256', secret).update('nixl-node push_reg v1\n').update(body).digest();
}

/** The notification bytes: "PUSH_REG:" + msgpack (signed when a secret is given). */
export function encodePushReg(r: PushRegistration, secret?: string | Buffer): Buffer {
  checkFields(r as unknown as Record<string, unknown>, DEFAULT_REG_LIMITS);
  const m = toMap(r);
  if (secret !== undefined) m.set(PUSH_REG_SIGNATURE_KEY, mac(r, secret).toString('hex'));
  return Buffer.concat([PUSH_REG_PREFIX, packMsgpack(m)]);
}

/** Whether a notification is a registration (by its prefix). */
export function isPushReg(msg: Uint8Array): boolean {
  return msg.length >= PUSH_REG_PREFIX.length && PUSH_REG_PREFIX.equals(msg.subarray(0, PUSH_REG_PREFIX.length));
}

/**
 * Reads a registration: vLLM's keys in any order, extra keys ignored, a flat
 * local_block_ids as one group, remote_pp_size 1 when absent (vLLM's older
 * push). Anything else, too large, or (with a secret) unsigned or forged is
 * a NixlError (INVALID_PARAM; NOT_ALLOWED for the signature).
 */
export function decodePushReg(msg: Uint8Array, opts: { secret?: string | Buffer; limits?: PushRegLimits } = {}) {
  const lim = { ...DEFAULT_REG_LIMITS, ...opts.limits };
  if (!isPushReg(msg)) throw bad('not a registration (no PUSH_REG: prefix)');
  if (msg.length > lim.maxBytes) throw bad(`${msg.length} bytes, over the limit of ${lim.maxBytes}`);
  const o = unpackMsgpack(msg.subarray(PUSH_REG_PREFIX.length), 'PUSH_REG');
  if (typeof o !== 'object' || o === null || Array.isArray(o) || Buffer.isBuffer(o)) throw bad('not a map');
  const d = o as Record<string, unknown>;
  if (Array.isArray(d.local_block_ids) && d.local_block_ids.every((x) => !Array.isArray(x)))
    d.local_block_ids = [d.local_block_ids];
  const r: PushRegistration = {
    requestId: d.request_id as string,
    decodeEngineId: d.decode_engine_id as string,
    decodeHost: d.decode_host as string,
    decodePort: d.decode_port as number,
    decodeTpSize: d.decode_tp_size as number,
    localBlockIds: d.local_block_ids as number[][],
    remoteEngineId: d.remote_engine_id as string,
    remoteHost: d.remote_host as string,
    remotePort: d.remote_port as number,
    remoteTpSize: d.remote_tp_size as number,
    remotePpSize: (d.remote_pp_size ?? 1) as number,
  };
  if (d.nixl_node_confirm === true) r.confirm = true;
  if (d.nixl_node_deadline_ms !== undefined) r.deadlineMs = d.nixl_node_deadline_ms as number;
  if (d.nixl_node_sent_at_ms !== undefined) r.sentAtMs = d.nixl_node_sent_at_ms as number;
  checkFields(r as unknown as Record<string, unknown>, lim);
  if (opts.secret !== undefined) verify(r, d[PUSH_REG_SIGNATURE_KEY], opts.secret);
  return r;
}

function verify(r: PushRegistration, sig: unknown, secret: string | Buffer): void {
  if (typeof sig !== 'string')
    throw new NixlError(
      `PUSH_REG of request '${r.requestId}' is not signed and this prefill requires signed registrations`,
      'NIXL_ERR_NOT_ALLOWED',
    );
  const want = mac(r, secret);
  const got = /^[0-9a-f]{64}$/.test(sig) ? Buffer.from(sig, 'hex') : Buffer.alloc(0);
  if (got.length !== want.length || !timingSafeEqual(got, want))
    throw new NixlError(
      `PUSH_REG of request '${r.requestId}': signature does not match (forged or altered, or another secret)`,
      'NIXL_ERR_NOT_ALLOWED',
    );
}

const isStr = (v: unknown, max: number) => typeof v === 'string' && v.length > 0 && v.length <= max;
const isInt = (v: unknown, lo: number, hi: number) =>
  typeof v === 'number' && Number.isInteger(v) && v >= lo && v <= hi;

function checkFields(d: Record<string, unknown>, lim: Required<PushRegLimits>): void {
  if (!isStr(d.requestId, 256) || !isNotifId(d.requestId as string))
    throw bad(`request_id must be a str of 1..256 characters usable in a notification, got ${show(d.requestId)}`);
  for (const k of ['decodeEngineId', 'remoteEngineId', 'decodeHost', 'remoteHost'])
    if (!isStr(d[k], 256)) throw bad(`${k} must be a str of 1..256 characters, got ${show(d[k])}`);
  for (const k of ['decodePort', 'remotePort'])
    if (!isInt(d[k], 1, 65535)) throw bad(`${k} must be a port, got ${show(d[k])}`);
  for (const k of ['decodeTpSize', 'remoteTpSize', 'remotePpSize'])
    if (!isInt(d[k], 1, 1024)) throw bad(`${k} must be an integer in 1..1024, got ${show(d[k])}`);
  if (d.deadlineMs !== undefined && !isInt(d.deadlineMs, 0, 2 ** 31 - 1))
    throw bad(`nixl_node_deadline_ms must be an integer in 0..2^31-1, got ${show(d.deadlineMs)}`);
  if (d.sentAtMs !== undefined && !isInt(d.sentAtMs, 0, Number.MAX_SAFE_INTEGER))
    throw bad(`nixl_node_sent_at_ms must be an integer in 0..2^53-1, got ${show(d.sentAtMs)}`);
  const g = d.localBlockIds;
  if (!Array.isArray(g) || g.length === 0 || g.length > lim.maxGroups)
    throw bad(`local_block_ids must be 1..${lim.maxGroups} lists of block ids`);
  let n = 0;
  for (const ids of g) {
    if (!Array.isArray(ids)) throw bad('local_block_ids: a group that is not a list');
    n += ids.length;
    if (n > lim.maxBlocks) throw bad(`local_block_ids: over ${lim.maxBlocks} block ids`);
    if (!ids.every((b) => isInt(b, 0, 2 ** 31 - 1)))
      throw bad('local_block_ids: block ids must be integers in 0..2^31-1');
  }
  if (n === 0) throw bad('local_block_ids names no block');
}

/** An id that cannot be read as a heartbeat, a list or another message ("<id>:<n>", "HB:a,b"). */
export function isNotifId(id: string): boolean {
  // biome-ignore lint/suspicious/noControlCharactersInRegex: the check is for control characters
  return id.length > 0 && id.length <= 256 && !id.startsWith('HB:') && !/[,\s\x00-\x1f\x7f]/.test(id);
}

/** What a push decode is told of its prefill (kv_transfer_params from the proxy). */
export interface PushParams {
  remoteEngineId: string;
  /** Heartbeats name it (vLLM: the prefill's id when the proxy knows it, else the router's). */
  remoteRequestId: string;
  remoteHost: string;
  remotePort: number;
  tpSize: number;
  /** The prefill's pipeline ranks: one WRITE notification per rank is expected. Required. */
  ppSize: number;
}

/**
 * Reads the kv_transfer_params a push decode gets (vLLM's push scheduler
 * reads remote_engine_id, remote_host, remote_port, tp_size and
 * remote_request_id by subscript). pp_size is required here: without it a
 * pipeline-parallel prefill's first stage would complete the request.
 * transfer_mode 'pull' (a pull prefill's params) is a TransferModeError.
 */
export function parsePushParams(o: unknown): PushParams {
  const p = (m: string) => new NixlError(`push kv_transfer_params: ${m}`, 'NIXL_ERR_INVALID_PARAM');
  if (typeof o !== 'object' || o === null || Array.isArray(o)) throw p('expected a JSON object');
  const d = o as Record<string, unknown>;
  if (d.transfer_mode !== undefined && d.transfer_mode !== null && d.transfer_mode !== 'push') {
    if (d.transfer_mode === 'pull') throw new TransferModeError('push', 'pull');
    throw p(`transfer_mode must be 'push', got ${show(d.transfer_mode)}`);
  }
  if (d.do_remote_prefill !== undefined && d.do_remote_prefill !== true) throw p('do_remote_prefill must be true');
  for (const k of ['remote_engine_id', 'remote_host', 'remote_request_id'])
    if (!isStr(d[k], 256)) throw p(`'${k}' must be a str of 1..256 characters, got ${show(d[k])}`);
  if (!isNotifId(d.remote_request_id as string))
    throw p(`remote_request_id ${show(d.remote_request_id)} cannot be used in a heartbeat`);
  if (!isInt(d.remote_port, 1, 65535)) throw p(`'remote_port' must be a port, got ${show(d.remote_port)}`);
  if (!isInt(d.tp_size, 1, 1024)) throw p(`'tp_size' must be an integer in 1..1024, got ${show(d.tp_size)}`);
  if (d.pp_size === undefined)
    throw p("'pp_size' is missing: a push decode must know how many pipeline ranks WRITE (one notification each)");
  if (!isInt(d.pp_size, 1, 64)) throw p(`'pp_size' must be an integer in 1..64, got ${show(d.pp_size)}`);
  return {
    remoteEngineId: d.remote_engine_id as string,
    remoteRequestId: d.remote_request_id as string,
    remoteHost: d.remote_host as string,
    remotePort: d.remote_port as number,
    tpSize: d.tp_size as number,
    ppSize: d.pp_size as number,
  };
}

/** What a decode rank expects: pp_size x max(1, P_tp // D_tp) WRITE notifications (vLLM's push worker). */
export function expectedWrites(ppSize: number, prefillTp: number, decodeTp: number): number {
  return ppSize * Math.max(1, Math.floor(prefillTp / decodeTp));
}

/** The notification of a push WRITE: "<decode request id>:<prefill TP size>". */
export function writeNotif(decodeRequestId: string, prefillTp: number): string {
  return `${decodeRequestId}:${prefillTp}`;
}

/** vLLM's get_base_request_id: the id without a trailing "-" + 8 hex digits. */
export function baseRequestId(id: string): string {
  return id.replace(/-[0-9a-f]{8}$/, '');
}

/** What a nixl-node prefill sends a nixl-node decode whose push it will not write (vLLM decodes never get it). */
export const PUSH_REFUSED_PREFIX = 'NIXL_NODE_PUSH_REFUSED:';
const REFUSAL_MAX_BYTES = 2048;

/** A refusal of a push: the decode's request id, the NixlError code and why (cut to fit a notification). */
export interface PushRefusal {
  requestId: string;
  code: string;
  reason: string;
}

export function encodeRefusal(r: PushRefusal): string {
  const reason = r.reason.slice(0, 1024);
  return `${PUSH_REFUSED_PREFIX}${JSON.stringify({ request_id: r.requestId, code: r.code, reason })}`;
}

/** A refusal, or undefined when the notification is not a well-formed one (never an exception). */
export function decodeRefusal(msg: string): PushRefusal | undefined {
  if (!msg.startsWith(PUSH_REFUSED_PREFIX) || msg.length > REFUSAL_MAX_BYTES) return undefined;
  let o: { request_id?: unknown; code?: unknown; reason?: unknown };
  try {
    o = JSON.parse(msg.slice(PUSH_REFUSED_PREFIX.length));
  } catch {
    return undefined;
  }
  if (typeof o !== 'object' || o === null) return undefined;
  const { request_id: requestId, code, reason } = o;
  if (typeof requestId !== 'string' || !isNotifId(requestId)) return undefined;
  if (typeof code !== 'string' || !/^NIXL_ERR_[A-Z_]{1,40}$/.test(code) || typeof reason !== 'string') return undefined;
  return { requestId, code, reason };
}

/** The wire profile a push side speaks (`wire` as given), refused unless it carries push (v12). */
export function pushWire(wire: WireName | WireProfile | undefined): WireProfile {
  const w = wireProfile(wire);
  if (!w.transferModes.includes('push'))
    throw new NixlError(`push mode is not part of the ${w.name} wire format (use v12)`, 'NIXL_ERR_NOT_SUPPORTED');
  return w;
}
