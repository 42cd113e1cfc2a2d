// A worker's listeners: its API front (HTTP, or the proxy's ZeroMQ
// protocol) and, when asked for, a port of its own for /metrics and /health.
import type * as http from 'node:http';
import type { FrontHandler } from './fronts/front';
import { serveHttp } from './fronts/http';
import { MetricsPort } from './fronts/metrics-port';
import { ZmqFront } from './fronts/zmq';
import type { WorkerOptions } from './options';

export class Listeners {
  private constructor(
    /** HTTP: the base URL; ZMQ: the address to PUSH to. */
    readonly address: string,
    readonly http?: http.Server,
    readonly zmq?: ZmqFront,
    readonly metricsPort?: MetricsPort,
  ) {}

  /** Opens the front the options name, on host, then the metrics port. */
  static async open(w: FrontHandler, o: WorkerOptions, host: string): Promise<Listeners> {
    const maxBodyBytes = o.maxBodyBytes ?? 1 << 20;
    let l: Listeners;
    if ((o.transport ?? 'http') === 'http') {
      const h = await serveHttp(w, {
        host,
        port: o.port ?? 0,
        maxBodyBytes,
        requestTimeoutMs: o.requestTimeoutMs ?? 30_000,
      });
      l = new Listeners(h.url, h.server);
    } else {
      const z = await ZmqFront.bind(w, o.zmqAddr ?? `tcp://${host}:*`, maxBodyBytes);
      l = new Listeners(z.address, undefined, z);
    }
    try {
      return new Listeners(l.address, l.http, l.zmq, await MetricsPort.open(w, host, o));
    } catch (e) {
      await l.close();
      throw e;
    }
  }

  /** Where the metrics port serves /metrics and /health, or undefined. */
  get metricsUrl(): string | undefined {
    return this.metricsPort?.url;
  }

  async close(): Promise<void> {
    this.zmq?.close();
    if (this.http) {
      const server = this.http;
      server.closeAllConnections();
      await new Promise((r) => server.close(r));
    }
    await this.metricsPort?.close();
  }
}
