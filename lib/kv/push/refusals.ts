// Telling a nixl-node decode rank that its registration will not be written
// (NIXL_NODE_PUSH_REFUSED), so that it fails at once instead of at its
// deadline. A registration given up while it waited for its request comes
// from a decode the prefill has not handshaked back to yet, and a
// notification needs the peer's agent loaded: the prefill then handshakes
// back to the decode the registration names (as it would to write), a few
// decodes at a time and one per sending agent (a flooder naming unreachable
// decodes holds one slot, not all), queued per decode. Only the agent that
// sent the registration is told; vLLM decodes (no nixl_node_confirm) are never
// sent one.
import type { NixlAgent } from '../../agent';
import type { NixlError } from '../../errors';
import type { HandshakeLogger } from '../../handshake/types';
import { type RemoteEndpoint, engineKey } from '../engine-connect';
import type { ReceivedReg } from './pairing';
import { encodeRefusal } from './reg';
import type { PeerEngines } from '../peers';

/** Handshakes back under way at once just to deliver refusals, and refusals queued behind each. */
const MAX_CONNECTS = 4;
const MAX_QUEUED = 1024;

/** Counters kept in the sender's stats: refusals sent, and those that could not be. */
interface Counts {
  refusalsSent: number;
  refusalsLost: number;
}

/** @internal */
export class Refusals {
  readonly #agent: NixlAgent;
  readonly #engines: PeerEngines;
  readonly #n: Counts;
  readonly #log: HandshakeLogger;
  readonly #queued = new Map<string, Array<[string, string]>>();
  /** Sending agents with a handshake back under way for their refusals. */
  readonly #connecting = new Set<string>();
  /** A flood is logged once a second at most: when, and how many were not logged since. */
  #loggedAt = Number.NEGATIVE_INFINITY;
  #unlogged = 0;

  constructor(agent: NixlAgent, engines: PeerEngines, counts: Counts, log: HandshakeLogger) {
    this.#agent = agent;
    this.#engines = engines;
    this.#n = counts;
    this.#log = log;
  }

  /** Logs a registration not kept (rate-limited: a flood is one line a second). */
  warn(message: string): void {
    const now = performance.now();
    if (now - this.#loggedAt < 1000) {
      this.#unlogged++;
      return;
    }
    const more = this.#unlogged ? ` (and ${this.#unlogged} more not logged in the last second)` : '';
    this.#log.warn(`push: ${message}${more}`);
    this.#loggedAt = now;
    this.#unlogged = 0;
  }

  /** Tells the agent that sent `r` (a nixl-node decode rank) that it will not be written, and why. */
  tell(r: ReceivedReg, e: NixlError): void {
    if (!r.reg.confirm) return;
    const msg = encodeRefusal({ requestId: r.reg.requestId, code: e.code, reason: e.message });
    if (this.#send(r.from, msg)) return;
    const ep: RemoteEndpoint = {
      host: r.reg.decodeHost,
      port: r.reg.decodePort,
      tpSize: r.reg.decodeTpSize,
      engineId: r.reg.decodeEngineId,
    };
    const k = engineKey(ep);
    const q = this.#queued.get(k);
    if (q) {
      if (q.length < MAX_QUEUED) q.push([r.from, msg]);
      else this.#n.refusalsLost++;
      return;
    }
    // A flooder may name many decodes: a bounded number of handshakes back, the rest are not told.
    if (this.#queued.size >= MAX_CONNECTS || this.#connecting.has(r.from)) {
      this.#n.refusalsLost++;
      return;
    }
    this.#queued.set(k, [[r.from, msg]]);
    this.#connecting.add(r.from);
    void this.#engines
      .get(ep)
      .catch(() => undefined)
      .then(() => {
        const all = this.#queued.get(k) ?? [];
        this.#queued.delete(k);
        this.#connecting.delete(r.from);
        for (const [a, m] of all) if (!this.#send(a, m)) this.#n.refusalsLost++;
      });
  }

  #send(agentName: string, msg: string): boolean {
    try {
      this.#agent.sendNotif(agentName, msg);
      this.#n.refusalsSent++;
      return true;
    } catch {
      // not loaded here (no handshake back yet), or gone
      return false;
    }
  }
}
