// Agents for the benchmarks on either engine. NIXL runs UCX over shared
// memory on this host unless UCX_TLS says otherwise.
import { NixlAgent } from '../lib';

export type Engine = 'loopback' | 'nixl';

export function benchAgent(name: string, engine: Engine, o: { captureTelemetry?: boolean } = {}): NixlAgent {
  if (engine === 'nixl') {
    process.env.UCX_TLS ??= 'sm,self';
    return new NixlAgent(name, {
      engine,
      progressThread: true,
      progressDelayUs: 1000,
      backendParams: { UCX: { ucx_error_handling_mode: 'none' } },
    });
  }
  return new NixlAgent(name, { engine, ...o });
}
