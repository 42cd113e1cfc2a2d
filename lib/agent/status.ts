// An engine's transfer status as the addon returns it: a number (0 done, 1 in
// progress) or [code, message] for a failure; -1 is "never posted".
import { NixlError } from '../errors';
import type { XferState } from './types';

export type NativeStatus = number | [number, string];

export function stateOf(status: NativeStatus): XferState {
  const s = typeof status === 'number' ? status : status[0];
  return s === 0 ? 'DONE' : s === 1 ? 'PROC' : 'ERR';
}

export function errorOf(status: NativeStatus): NixlError | undefined {
  return Array.isArray(status) ? NixlError.fromStatus(status[0], status[1] || 'transfer failed') : undefined;
}

export const neverPosted = (s: NativeStatus): boolean => Array.isArray(s) && s[0] === -1;
