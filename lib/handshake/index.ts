// Picks a handshake strategy: option, else NIXL_HANDSHAKE_METHOD (zmq|http), else zmq.
// The wire profile is chosen per call (option, else NIXL_WIRE, else v12).
import { HttpHandshake } from './http';
import type { HandshakeMethod, HandshakeStrategy } from './types';
import { zmqHandshake } from './zmq';

/** The side channel for a method: the option, else NIXL_HANDSHAKE_METHOD, else zmq. */
export function createHandshake(method?: HandshakeMethod, opts: { keepAlive?: boolean } = {}): HandshakeStrategy {
  const m = method ?? (process.env.NIXL_HANDSHAKE_METHOD as HandshakeMethod | undefined) ?? 'zmq';
  if (m === 'zmq') return zmqHandshake;
  if (m === 'http') return new HttpHandshake(opts.keepAlive ?? true);
  throw new RangeError(`handshake method '${m}': expected 'zmq' or 'http' (NIXL_HANDSHAKE_METHOD)`);
}

export * from './codec';
export * from './model';
export * from './types';
export * from './wire';
export { wireV013 } from './wire-v0.13';
export { wireV12 } from './wire-v12';
export { HttpHandshake, HTTP_SCHEMA } from './http';
export { zmqHandshake } from './zmq';
