// The lease board: how a nixl-node prefill proves to a nixl-node decode that
// it still held a request's blocks when the decode's read ended, whatever the
// decode's own clock says. vLLM peers never see it.
//
// The prefill registers a small board of slots with its agent and names it in
// its v12 metadata (nixl_node_lease_board: [address, slots], a key vLLM
// ignores). A request's slot is one of PROBE slots from a hash of its id; it
// holds [tag, state] (two little-endian u64): the id's 64-bit hash, and HELD
// while the tracker holds the blocks. The tracker writes the released state
// (read, expired, aborted) *before* it gives the blocks back.
//
// A decode reads its KV without a notification, then reads the request's
// slots (one small READ). Finding its tag HELD means nothing freed the blocks
// before that moment, so the KV it read earlier is the request's; then it
// sends the completion notification, which lets the prefill free them. Any
// other answer (released, reused, not found) fails the pull as 'expired'.
import { createHash } from 'node:crypto';
import type { NixlAgent, RegisteredMemory } from '../agent';
import { allocate } from '../descriptors';
import { NixlError } from '../errors';

export const PROBE = 8;
export const SLOT_BYTES = 16;

/** What a prefill's lease board says of a request's blocks. */
export enum SlotState {
  FREE = 0,
  HELD = 1,
  READ = 2,
  EXPIRED = 3,
  ABORTED = 4,
}

/** The request id's tag (never 0) and its first slot. */
export function slotOf(requestId: string, slots: number): { tag: bigint; first: number } {
  const d = createHash('sha256').update(requestId).digest();
  const tag = d.readBigUInt64LE(0) | 1n;
  return { tag, first: d.readUInt32LE(8) % slots };
}

/** The prefill side: one board per prefill rank (agent). */
export class LeaseBoard {
  readonly mem: Buffer;
  readonly slots: number;

  constructor(slots = 8192) {
    if (!Number.isInteger(slots) || slots < PROBE)
      throw new NixlError(`a lease board needs at least ${PROBE} slots`, 'NIXL_ERR_INVALID_PARAM');
    this.slots = slots;
    // Shared memory: loopback peers map it, as they map the KV.
    this.mem = allocate((slots + PROBE) * SLOT_BYTES);
    this.mem.fill(0);
  }

  /** Marks a request held (in the first of its slots not held by another). False: no slot free. */
  hold(requestId: string): boolean {
    const { tag, first } = slotOf(requestId, this.slots);
    for (let i = 0; i < PROBE; i++) {
      const at = (first + i) * SLOT_BYTES;
      if (this.mem.readBigUInt64LE(at + 8) === BigInt(SlotState.HELD)) continue;
      // State first (not HELD), then the tag, then HELD: a reader that tears
      // sees an old tag or a state other than HELD, and fails closed.
      this.mem.writeBigUInt64LE(BigInt(SlotState.FREE), at + 8);
      this.mem.writeBigUInt64LE(tag, at);
      this.mem.writeBigUInt64LE(BigInt(SlotState.HELD), at + 8);
      return true;
    }
    return false;
  }

  /** The request's blocks are being released, for `state`'s reason: call before they are reused. */
  release(requestId: string, state: SlotState.READ | SlotState.EXPIRED | SlotState.ABORTED): void {
    const { tag, first } = slotOf(requestId, this.slots);
    for (let i = 0; i < PROBE; i++) {
      const at = (first + i) * SLOT_BYTES;
      if (this.mem.readBigUInt64LE(at) === tag) this.mem.writeBigUInt64LE(BigInt(state), at + 8);
    }
  }
}

/** The decode side: what PROBE slots read from a board say of a request. */
export function boardVerdict(slots: Uint8Array, requestId: string, boardSlots: number): 'held' | SlotState | 'missing' {
  const { tag } = slotOf(requestId, boardSlots);
  const b = Buffer.from(slots.buffer, slots.byteOffset, slots.byteLength);
  for (let i = 0; i < PROBE; i++) {
    if (b.readBigUInt64LE(i * SLOT_BYTES) !== tag) continue;
    const state = Number(b.readBigUInt64LE(i * SLOT_BYTES + 8));
    return state === SlotState.HELD ? 'held' : (state as SlotState);
  }
  return 'missing';
}

/** Registers a board with the agent that serves it (once), so decodes can read it. */
export function registerBoard(board: LeaseBoard, agent: NixlAgent): void {
  let agents = registered.get(board);
  if (!agents) {
    agents = new WeakSet();
    registered.set(board, agents);
  }
  if (agents.has(agent)) return;
  agent.registerMemory(board.mem);
  agents.add(agent);
}
const registered = new WeakMap<LeaseBoard, WeakSet<NixlAgent>>();

/**
 * The decode side: reads a request's slots from a prefill rank's board into
 * small registered buffers of its own (a free list of them; one more is
 * registered when all are in use).
 */
export class BoardReader {
  readonly #agent: NixlAgent;
  readonly #free: Buffer[] = [];
  readonly #regs: RegisteredMemory[] = [];

  constructor(agent: NixlAgent) {
    this.#agent = agent;
  }

  /** What the board of `remoteAgent` at `board` = [address, slots] says of `requestId` now. */
  async verdict(
    remoteAgent: string,
    board: readonly bigint[],
    requestId: string,
    timeoutMs: number,
  ): Promise<'held' | SlotState | 'missing'> {
    const slots = Number(board[1]);
    const { first } = slotOf(requestId, slots);
    const buf = this.#take();
    try {
      await this.#agent.read(
        buf,
        [{ addr: board[0] + BigInt(first * SLOT_BYTES), len: PROBE * SLOT_BYTES }],
        remoteAgent,
        { timeoutMs },
      );
      return boardVerdict(buf, requestId, slots);
    } finally {
      this.#free.push(buf);
    }
  }

  #take(): Buffer {
    const b = this.#free.pop();
    if (b) return b;
    // 64 reads' worth at a time.
    const chunk = Buffer.alloc(64 * PROBE * SLOT_BYTES);
    this.#regs.push(this.#agent.registerMemory(chunk));
    for (let i = 1; i < 64; i++) this.#free.push(chunk.subarray(i * PROBE * SLOT_BYTES, (i + 1) * PROBE * SLOT_BYTES));
    return chunk.subarray(0, PROBE * SLOT_BYTES);
  }

  close(): void {
    for (const r of this.#regs.splice(0)) {
      try {
        this.#agent.deregisterMemory(r);
      } catch {
        /* agent closed */
      }
    }
    this.#free.length = 0;
  }
}
