// The decode side of push mode (vLLM's NixlPushConnector as the consumer):
// handshake notif-only with the prefill ranks this rank maps to, send each
// the PUSH_REG naming our blocks, keep the prefill's lease alive with
// heartbeats, and count the WRITE notifications "<our id>:<prefill TP>" up
// to pp_size x max(1, P_tp // D_tp) (vLLM's push worker).
//
// It fails closed, unlike vLLM (whose decode waits forever): each request has
// its own deadline, and a request that has not received every WRITE by then
// fails with a PushError. A block it registered cannot be known free of
// WRITEs then, so it goes into quarantine (quarantine.ts) until the
// prefill's lease is over, and receive() refuses quarantined blocks. A
// nixl-node prefill is also told the deadline (nixl_node_deadline_ms, a key
// vLLM ignores) and posts nothing after it.
//
// KvPushReceiver wires the roles together: the receive as a pipeline of
// stages (receive.ts), the waits for WRITE notifications (write-waits.ts),
// lease keeping (leases.ts) and the agent's peers (peers.ts).
import { NixlError } from '../../errors';
import type { WireProfile } from '../../handshake/model';
import { type RemoteEndpoint, engineKey } from '../engine-connect';
import { checkLayout } from '../layout';
import { LeaseKeeper } from '../leases';
import { type KvPeers, type PeerEngines, peersFor } from '../peers';
import type { RemoteEngine } from '../remote-engines';
import { BlockQuarantine } from './quarantine';
import { PushReceive, type ReceiveDeps } from './receive';
import { type PushParams, pushWire } from './reg';
import type { KvPushReceiverOptions, PushReceived, ReceiveOptions } from './types';
import { WriteWaits } from './write-waits';

export type { KvPushReceiverOptions } from './types';

/** The decode side of push mode: registers blocks with a prefill and proves every WRITE arrived. */
export class KvPushReceiver {
  readonly quarantine = new BlockQuarantine();
  readonly #o: KvPushReceiverOptions;
  readonly #wire: WireProfile;
  readonly #peers: KvPeers;
  /** The peers were made here (else given: their maker closes them). */
  readonly #ownPeers: boolean;
  readonly #engines: PeerEngines;
  readonly #leases: LeaseKeeper<RemoteEndpoint, RemoteEngine>;
  readonly #waits: WriteWaits;
  readonly #deps: ReceiveDeps;
  #closed = false;

  constructor(o: KvPushReceiverOptions) {
    checkLayout(o.layout);
    if (typeof o.decodeHost !== 'string' || o.decodeHost.length === 0 || o.decodeHost.length > 256)
      throw new NixlError('decodeHost must be a host name of 1..256 characters', 'NIXL_ERR_INVALID_PARAM');
    if (!Number.isInteger(o.decodePort) || o.decodePort < 1 || o.decodePort > 65535)
      throw new NixlError(`decodePort must be a port, got ${o.decodePort}`, 'NIXL_ERR_INVALID_PARAM');
    this.#o = o;
    this.#wire = pushWire(o.wire ?? o.peers?.wire);
    const { peers, own } = peersFor(o, 'KvPushReceiver');
    this.#peers = peers;
    this.#ownPeers = own;
    this.#engines = peers.engines({ expectedHash: o.expectedHash, notifOnly: true });
    this.#waits = new WriteWaits(o.agent);
    this.#leases = new LeaseKeeper({
      wire: this.#wire,
      kvLeaseMs: o.kvLeaseMs,
      keyOf: engineKey,
      engineFor: (ep) => this.#engines.get(ep),
      notify: (name, msg) => this.#send(name, msg),
    });
    this.#deps = {
      o,
      wire: this.#wire,
      leaseMs: o.kvLeaseMs ?? this.#wire.defaultLeaseMs,
      engines: this.#engines,
      leases: this.#leases,
      quarantine: this.quarantine,
      waits: this.#waits,
      inUse: new Set(),
      send: (name, msg) => this.#send(name, msg),
      isClosed: () => this.#closed,
    };
  }

  /** Heartbeats sent so far. */
  get heartbeatsSent(): number {
    return this.#leases.heartbeatsSent;
  }

  /** WRITE notifications for a request after it failed (its blocks were in quarantine). */
  get lateWrites(): number {
    return this.#waits.lateWrites;
  }

  /** Notifications naming no receive of ours. */
  get unrecognized(): number {
    return this.#waits.unrecognized;
  }

  /**
   * Registers `localBlockIds` (our logical ids, one KV-cache group) with the
   * prefill the params name and resolves once every WRITE notification came;
   * PushError otherwise, by the deadline at the latest.
   */
  receive(params: PushParams | Record<string, unknown>, opts: ReceiveOptions): Promise<PushReceived> {
    return new PushReceive(this.#deps, params, opts).run();
  }

  #send(agentName: string, msg: string | Buffer): boolean {
    try {
      this.#o.agent.sendNotif(agentName, msg);
      return true;
    } catch (e) {
      if ((e as NixlError).code === 'NIXL_ERR_REMOTE_DISCONNECT') this.#waits.unreachable(agentName, e as NixlError);
      return false;
    }
  }

  /** What the receiver holds right now (tests check nothing leaks). */
  resources(): { receiving: number; gaveUp: number; quarantined: number; engines: number; remoteAgents: number } {
    return {
      receiving: this.#waits.size,
      gaveUp: this.#waits.gaveUpSize,
      quarantined: this.quarantine.size,
      engines: this.#engines.size,
      remoteAgents: this.#engines.remoteAgents,
    };
  }

  /** Stops: receives in flight fail (their blocks go into quarantine). */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#waits.close();
    this.#leases.close();
    if (this.#ownPeers) await this.#peers.close();
    this.quarantine.close();
  }
}
