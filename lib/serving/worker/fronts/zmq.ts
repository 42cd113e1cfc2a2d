// A worker's ZeroMQ front (docs/serving-zmq.md): one PULL socket for the
// proxy's requests, a PUSH socket per proxy for the answers; what each
// message does is zmq-dispatch.ts.
import * as zmq from 'zeromq';
import type { FrontHandler } from './front';
import { encodeMessage } from '../../api/zmq-protocol';
import { receiveLoop } from '../../api/zmq-receive';
import { ZmqDispatch } from './zmq-dispatch';
import { ReplySockets } from './zmq-replies';

export class ZmqFront {
  readonly #pull: zmq.Pull;
  readonly #replies: ReplySockets;
  readonly #dispatch: ZmqDispatch;
  #closed = false;

  private constructor(w: FrontHandler, pull: zmq.Pull) {
    this.#pull = pull;
    this.#replies = new ReplySockets(64, () => w.stats.repliesDropped++);
    this.#dispatch = new ZmqDispatch(w, (to, tag, r, skip) => {
      if (this.#closed) return false;
      let frames: Buffer[];
      try {
        frames = encodeMessage(tag, r);
      } catch {
        w.stats.repliesDropped++;
        return false;
      }
      return this.#replies.send(to, frames, skip);
    });
  }

  /** Reply sockets open now (one per proxy answered lately, at most 64). */
  get replySockets(): number {
    return this.#replies.size;
  }

  /** Answers waiting to go out on the reply sockets (at most 1000 per socket). */
  get pendingReplies(): number {
    return this.#replies.pending;
  }

  /**
   * Binds addr (tcp://host:port, tcp://host:* for any port, ipc://path) and
   * serves. A frame larger than maxBodyBytes makes ZeroMQ drop the message
   * and the connection it came on (ZMQ_MAXMSGSIZE); the sender reconnects.
   */
  static async bind(w: FrontHandler, addr: string, maxBodyBytes: number): Promise<ZmqFront> {
    const pull = new zmq.Pull({ linger: 0, maxMessageSize: maxBodyBytes });
    await pull.bind(addr);
    const f = new ZmqFront(w, pull);
    void receiveLoop(pull, (frames) => f.#dispatch.onMessage(frames));
    return f;
  }

  get address(): string {
    return this.#pull.lastEndpoint!;
  }

  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#dispatch.abortAll();
    this.#pull.close();
    this.#replies.close();
  }
}
