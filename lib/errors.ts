// NixlError: every failure of the library is one of these, with a string
// `code` and NIXL's numeric status. This file owns the table of status names;
// lib/native.ts hands the addon a factory built on it at load, so errors made
// in C++ are real instances (instanceof works). The names of the numbers come
// from the NIXL the addon was built against (status-table.ts), this table first.
// Pure: no addon needed.
import { statusName, statusValue, useStatusTable } from './status-table';

/** NIXL's status codes (nixl_status_t) by name. */
export const Status = {
  NIXL_IN_PROG: 1,
  NIXL_SUCCESS: 0,
  NIXL_ERR_NOT_POSTED: -1,
  NIXL_ERR_INVALID_PARAM: -2,
  NIXL_ERR_BACKEND: -3,
  NIXL_ERR_NOT_FOUND: -4,
  NIXL_ERR_MISMATCH: -5,
  NIXL_ERR_NOT_ALLOWED: -6,
  NIXL_ERR_REPOST_ACTIVE: -7,
  NIXL_ERR_UNKNOWN: -8,
  NIXL_ERR_NOT_SUPPORTED: -9,
  NIXL_ERR_REMOTE_DISCONNECT: -10,
  NIXL_ERR_CANCELED: -11,
  NIXL_ERR_NO_TELEMETRY: -12,
} as const;

useStatusTable(Status);

/**
 * NIXL's codes (NIXL_ERR_XFER_STALLED where the installed NIXL has it: a
 * transfer past its stall timeout, not aborted), plus NIXL_ERR_TIMEOUT for promise forms that gave up waiting
 * and NIXL_ERR_LEASE_EXPIRED for a KV pull that could not end inside the
 * prefill's lease on its blocks (KvPuller).
 */
export type NixlErrorCode =
  | Exclude<keyof typeof Status, 'NIXL_IN_PROG' | 'NIXL_SUCCESS'>
  | 'NIXL_ERR_XFER_STALLED'
  | 'NIXL_ERR_TIMEOUT'
  | 'NIXL_ERR_LEASE_EXPIRED';

/**
 * An error of a NIXL call, or of bad input refused before one: `code` names
 * it (NIXL_ERR_INVALID_PARAM, NIXL_ERR_NOT_FOUND...), `status` is NIXL's number.
 * A code the installed NIXL added after this release is named as its
 * nixl_types.h names it.
 */
export class NixlError extends Error {
  readonly code: NixlErrorCode;
  readonly status: number;

  constructor(message: string, code: NixlErrorCode | string, status?: number, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'NixlError';
    this.code = code as NixlErrorCode;
    this.status = status ?? statusValue(code) ?? Status.NIXL_ERR_UNKNOWN;
  }

  /** The error of a NIXL status code. */
  static fromStatus(status: number, message: string): NixlError {
    const name = status < 0 ? statusName(status) : undefined;
    return new NixlError(message, name ?? 'NIXL_ERR_UNKNOWN', status);
  }
}

export function invalidParam(message: string): NixlError {
  return new NixlError(message, 'NIXL_ERR_INVALID_PARAM');
}
