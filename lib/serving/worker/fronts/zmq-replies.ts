// The PUSH sockets a ZeroMQ worker answers on, one per reply_to address a
// request named. reply_to comes from whoever can reach the worker's PULL
// socket, so an address ZeroMQ refuses (garbage, udp://) drops that answer
// and nothing else, and the sockets are bounded: the least recently used one
// is closed when a new address would pass the cap (a deployment has a few
// proxies; a flood of addresses cannot exhaust the worker's descriptors).
// Answers waiting to go out on one socket are bounded too: an address that
// never reads (or where nobody listens) holds at most `maxPending` of them,
// and later ones are dropped and counted, so a flood of requests naming it
// cannot grow the worker's memory.
import * as zmq from 'zeromq';
import { SerialSender } from '../../api/zmq-protocol';

/** The transports a reply may go out on (what the proxy binds its PULL socket to). */
const REPLY_TO = /^(tcp:\/\/[^\s/]+:\d{1,5}|ipc:\/\/[^\s]+)$/;

export class ReplySockets {
  /** Insertion order is recency: the first entry is the least recently used. */
  readonly #open = new Map<string, SerialSender>();
  /** Answers handed to a socket and not yet sent (or failed), by address. */
  readonly #waiting = new Map<string, number>();
  #closed = false;

  constructor(
    /** Most sockets open at once. */
    readonly cap = 64,
    /** Called with each answer dropped because its address cannot be used. */
    private readonly dropped: (to: string, why: string) => void = () => {},
    /** Most answers waiting on one socket (ZeroMQ's own send queue, SNDHWM, is 1000). */
    readonly maxPending = 1000,
  ) {}

  /** Sockets open now. */
  get size(): number {
    return this.#open.size;
  }

  /** Answers waiting to be sent, on every socket. */
  get pending(): number {
    let n = 0;
    for (const v of this.#waiting.values()) n += v;
    return n;
  }

  /**
   * Sends an answer to `to`: true once sent, false when it was dropped (or
   * withheld: `skip` said so when its turn came). Never throws (a proxy that
   * is gone times the request out).
   */
  async send(to: string, frames: Buffer[], skip?: () => boolean): Promise<boolean> {
    if (this.#closed) return false;
    const waiting = this.#waiting.get(to) ?? 0;
    if (waiting >= this.maxPending) {
      this.dropped(to, `${waiting} answers already wait for it`);
      return false;
    }
    const s = this.#socket(to);
    if (!s) return false;
    this.#waiting.set(to, waiting + 1);
    try {
      await s.send(frames, skip);
      return true;
    } catch {
      return false; // the proxy is gone, the send timed out, or the socket was closed meanwhile
    } finally {
      const left = (this.#waiting.get(to) ?? 1) - 1;
      if (left > 0) this.#waiting.set(to, left);
      else this.#waiting.delete(to);
    }
  }

  #socket(to: string): SerialSender | undefined {
    let s = this.#open.get(to);
    if (s) {
      this.#open.delete(to);
      this.#open.set(to, s);
      return s;
    }
    if (to.length > 512 || !REPLY_TO.test(to)) {
      this.dropped(to, 'not a tcp:// or ipc:// address');
      return undefined;
    }
    let sock: zmq.Push | undefined;
    try {
      sock = new zmq.Push({ linger: 0, sendTimeout: 5000 });
      sock.connect(to);
    } catch (e) {
      // EINVAL, ENOCOMPATPROTO, or ZeroMQ out of sockets (EMFILE).
      sock?.close();
      this.dropped(to, (e as Error).message);
      return undefined;
    }
    s = new SerialSender(sock);
    this.#open.set(to, s);
    while (this.#open.size > this.cap) {
      const [oldest, o] = this.#open.entries().next().value as [string, SerialSender];
      this.#open.delete(oldest);
      o.socket.close();
    }
    return s;
  }

  /** Closes every socket; later sends are dropped. */
  close(): void {
    this.#closed = true;
    for (const s of this.#open.values()) s.socket.close();
    this.#open.clear();
  }
}
