// The error of a handshake that failed, shared by the codecs and the side channels.
import { NixlError } from '../errors';

/** A handshake that failed: a side channel refused, answered garbage, timed out or has another model. */
export class HandshakeError extends NixlError {
  constructor(message: string, code: string = 'NIXL_ERR_INVALID_PARAM', options?: { cause?: unknown }) {
    super(message, code, undefined, options);
    this.name = 'HandshakeError';
  }
}
