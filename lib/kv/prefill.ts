// The prefill side: serve each local rank's handshake payload, and count the
// decode side's "<request_id>:<decode_tp>" notifications to know when a
// request's blocks may be freed (or expire them after a timeout).
import type { NixlAgent, Notif } from '../agent';
import { createHandshake } from '../handshake';
import { encodeAgentMetadata } from '../handshake/codec';
import type {
  HandshakeLogger,
  HandshakeMethod,
  HandshakeServer,
  HandshakeStrategy,
  TlsServerOptions,
} from '../handshake/types';
import { defaultLogger } from '../handshake/types';
import { toAgentMetadata, type KvLayout } from './layout';
import { consumersPerProducer } from './tp';

export interface PrefillRank {
  agent: NixlAgent;
  layout: KvLayout;
}

export interface ServePrefillOptions {
  ranks: PrefillRank[];
  compatibilityHash: string;
  handshake?: HandshakeStrategy | HandshakeMethod;
  host?: string;
  port: number;
  dpRank?: number;
  tls?: TlsServerOptions;
  bearerToken?: string;
  logger?: HandshakeLogger;
}

/** Serves the payload of every given rank (re-call setPayload after registering more memory). */
export async function servePrefill(o: ServePrefillOptions): Promise<HandshakeServer> {
  const hs = typeof o.handshake === 'object' ? o.handshake : createHandshake(o.handshake);
  const payloads = new Map(
    o.ranks.map(({ agent, layout }) => [
      layout.tpRank,
      {
        compatibilityHash: o.compatibilityHash,
        agentMetadataBytes: encodeAgentMetadata(toAgentMetadata(layout, agent.getAgentMetadata())),
      },
    ]),
  );
  return hs.serve({
    host: o.host,
    port: o.port,
    dpRank: o.dpRank,
    payloads,
    tls: o.tls,
    bearerToken: o.bearerToken,
    logger: o.logger,
  });
}

const KV_NOTIF = /^(.+):(\d+)$/;

export interface Released {
  requestId: string;
  blockIds: number[];
  reason: 'read' | 'expired';
}

interface Pending {
  blockIds: number[];
  since: number; // performance.now() at expect()
  timer: NodeJS.Timeout;
  resolve(r: Released): void;
}

export interface PrefillTrackerOptions {
  agent: NixlAgent;
  /** This prefill engine's TP size. */
  tpSize: number;
  /** Free blocks of requests nobody read after this long (vLLM VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s). */
  expireMs?: number;
  logger?: HandshakeLogger;
}

/** Told of each release and each notification for an untracked request (registerKvMetrics). */
export interface PrefillTrackerSink {
  released(r: Released, heldMs: number): void;
  unrecognized(): void;
}

export class PrefillTracker {
  readonly sinks = new Set<PrefillTrackerSink>();
  readonly #o: PrefillTrackerOptions;
  readonly #pending = new Map<string, Pending>();
  /** Reads reported before expect() was called, with when they came. */
  readonly #early = new Map<string, { count: number; decodeTp: number; at: number }>();
  readonly #abort = new AbortController();
  #loop: Promise<void> | undefined;
  unrecognized = 0;

  constructor(o: PrefillTrackerOptions) {
    this.#o = o;
  }

  get pending(): number {
    return this.#pending.size;
  }

  /**
   * A request whose blocks wait for decode reads. Resolves when every decode
   * rank that reads this prefill rank has said so, or when it expires.
   */
  expect(requestId: string, blockIds: number[]): Promise<Released> {
    if (this.#pending.has(requestId)) throw new RangeError(`request '${requestId}' is already tracked`);
    this.#start();
    return new Promise<Released>((resolve) => {
      const timer = setTimeout(() => this.#finish(requestId, 'expired'), this.#o.expireMs ?? 480_000);
      this.#pending.set(requestId, { blockIds, since: performance.now(), timer, resolve });
      const e = this.#early.get(requestId);
      if (e) {
        this.#early.delete(requestId);
        if (e.count >= consumersPerProducer(this.#o.tpSize, e.decodeTp)) this.#finish(requestId, 'read');
        else this.#early.set(requestId, e);
      }
    });
  }

  #start(): void {
    if (this.#loop) return;
    this.#loop = (async () => {
      while (!this.#abort.signal.aborted) {
        let n: Notif;
        try {
          n = await this.#o.agent.waitForNotif((x) => KV_NOTIF.test(x.msg.toString('utf8')), {
            signal: this.#abort.signal,
          });
        } catch {
          return; // closed
        }
        this.#onNotif(n.msg.toString('utf8'));
      }
    })();
  }

  #onNotif(msg: string): void {
    const m = KV_NOTIF.exec(msg)!;
    const [requestId, decodeTp] = [m[1], Number(m[2])];
    const now = Date.now();
    const e = this.#early.get(requestId) ?? { count: 0, decodeTp, at: now };
    e.count++;
    if (this.#pending.has(requestId)) {
      if (e.count >= consumersPerProducer(this.#o.tpSize, decodeTp)) {
        this.#early.delete(requestId);
        this.#finish(requestId, 'read');
      } else {
        this.#early.set(requestId, e);
      }
      return;
    }
    this.unrecognized++;
    for (const s of this.sinks) s.unrecognized();
    (this.#o.logger ?? defaultLogger).warn(`notification for request '${requestId}' that is not (yet) tracked`);
    this.#early.set(requestId, e);
    // Forget stale early reports.
    for (const [k, v] of this.#early) if (now - v.at > (this.#o.expireMs ?? 480_000)) this.#early.delete(k);
  }

  #finish(requestId: string, reason: 'read' | 'expired'): void {
    const p = this.#pending.get(requestId);
    if (!p) return;
    this.#pending.delete(requestId);
    clearTimeout(p.timer);
    const r: Released = { requestId, blockIds: p.blockIds, reason };
    for (const s of this.sinks) s.released(r, performance.now() - p.since);
    p.resolve(r);
  }

  /** Stops listening; pending requests are released as expired. */
  async close(): Promise<void> {
    this.#abort.abort();
    await this.#loop;
    for (const id of [...this.#pending.keys()]) this.#finish(id, 'expired');
  }
}
