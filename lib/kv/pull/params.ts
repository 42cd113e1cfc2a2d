// What KvPuller.pullFromParams checks of kv_transfer_params before it reads
// anything, and how it turns them into a pull.
import { NixlError } from '../../errors';
import type { KvTransferParams, WireProfile } from '../../handshake/model';
import { TransferModeError, parseKvTransferParams } from '../../handshake/wire';
import type { RemoteEndpoint } from '../engine-connect';
import type { KvLayout } from '../layout';
import { type PullLimits, checkRemoteSizes } from '../limits';
import { verifyKvTransferParams } from '../params-auth';

/** @internal */
export interface ParamsCheck {
  layout: KvLayout;
  wire: WireProfile;
  limits: Required<PullLimits>;
  paramsSecret?: string | Buffer;
}

/**
 * The parsed params of one pull, or a NixlError saying why they cannot be
 * pulled from: a bad signature, an id that cannot go in a notification, push
 * mode (TransferModeError), several KV-cache groups, more blocks than the local cache holds, or
 * remote sizes over the limits.
 * @internal
 */
export function checkedParams(
  params: KvTransferParams | Record<string, unknown>,
  localLogicalBlocks: number,
  c: ParamsCheck,
): KvTransferParams {
  if (c.paramsSecret !== undefined) {
    if (isParsed(params))
      throw new NixlError(
        'signed kv_transfer_params are checked as the prefill sent them: pass the JSON object, not parsed params',
        'NIXL_ERR_INVALID_PARAM',
      );
    verifyKvTransferParams(params, c.paramsSecret);
  }
  const p = isParsed(params) ? params : parseKvTransferParams(params, c.wire);
  checkRequestId(p.remoteRequestId);
  // A push prefill's params: its blocks are WRITTEN by it (KvPushReceiver), never read.
  if (p.transferMode !== 'pull') throw new TransferModeError('pull', p.transferMode);
  if (p.remoteBlockIds.length !== 1)
    throw new NixlError(
      `${p.remoteBlockIds.length} KV-cache groups: nixl-node pulls one group`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  const ratio = c.layout.physicalBlocksPerLogical ?? 1;
  if (localLogicalBlocks * ratio > c.layout.numBlocks)
    throw new NixlError(
      `${localLogicalBlocks} local logical blocks (x ${ratio}) exceed the local cache of ${c.layout.numBlocks} blocks`,
      'NIXL_ERR_INVALID_PARAM',
    );
  checkRemoteSizes(c.layout, endpointOf(p), c.limits);
  return p;
}

/** The request id the params name, parsed or not (for errors). @internal */
export function paramsRequestId(params: KvTransferParams | Record<string, unknown>): string {
  return isParsed(params) ? params.remoteRequestId : String(params.remote_request_id ?? '');
}

/**
 * A request id becomes part of notifications ("<id>:<n>", "HB:<id>,<id>"):
 * one that could read as a heartbeat, a list or another message is refused.
 */
function checkRequestId(id: string): void {
  // biome-ignore lint/suspicious/noControlCharactersInRegex: the check is for control characters
  if (id.length === 0 || id.length > 256 || id.startsWith('HB:') || /[,\s\x00-\x1f\x7f]/.test(id))
    throw new NixlError(
      `remote_request_id ${JSON.stringify(id.slice(0, 80))} cannot be used in a notification (empty, over 256 characters, starts with 'HB:', or holds ',' or white space)`,
      'NIXL_ERR_INVALID_PARAM',
    );
}

function isParsed(p: KvTransferParams | Record<string, unknown>): p is KvTransferParams {
  return 'remoteBlockIds' in p;
}

/** The prefill engine the params name. @internal */
export function endpointOf(p: KvTransferParams): RemoteEndpoint {
  // remote_port already includes the prefill's DP index.
  return {
    host: p.remoteHost,
    port: p.remotePort,
    tpSize: p.tpSize,
    ppSize: p.ppSize,
    dcpSize: p.dcpSize,
    engineId: p.remoteEngineId,
  };
}

/** vLLM's _logical_to_kernel_block_ids: logical id b covers kernel blocks b*r .. b*r + r-1. */
export function expand(logical: ArrayLike<number>, r: number): number[] {
  if (r === 1) return Array.from(logical);
  const out: number[] = [];
  for (let i = 0; i < logical.length; i++) for (let j = 0; j < r; j++) out.push(logical[i] * r + j);
  return out;
}
