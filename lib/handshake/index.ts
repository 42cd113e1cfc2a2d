// Picks a handshake strategy: option, else NIXL_HANDSHAKE_METHOD (zmq|http), else zmq.
import { HttpHandshake } from './http';
import type { HandshakeMethod, HandshakeStrategy } from './types';
import { zmqHandshake } from './zmq';

export function createHandshake(method?: HandshakeMethod, opts: { keepAlive?: boolean } = {}): HandshakeStrategy {
  const m = method ?? (process.env.NIXL_HANDSHAKE_METHOD as HandshakeMethod | undefined) ?? 'zmq';
  if (m === 'zmq') return zmqHandshake;
  if (m === 'http') return new HttpHandshake(opts.keepAlive ?? true);
  throw new RangeError(`handshake method '${m}': expected 'zmq' or 'http' (NIXL_HANDSHAKE_METHOD)`);
}

export * from './codec';
export * from './types';
export { HttpHandshake } from './http';
export { zmqHandshake } from './zmq';
