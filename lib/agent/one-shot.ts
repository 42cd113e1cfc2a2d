// read() and write(): a request made, posted, waited for and released in one call.
import { type DescList, type MemoryLike, toDescList } from '../descriptors';
import type { NotifMsg, WaitOptions, XferHandle, XferOp, XferOptions, XferState } from './types';

/** What a one-shot needs of an agent, by shape: agent.ts imports this file. */
interface Transfers {
  readonly closed: boolean;
  initializeXfer(op: XferOp, local: DescList, remote: DescList, remoteAgent: string, notifMsg?: NotifMsg): XferHandle;
  transfer(handle: XferHandle): XferState;
  wait(handle: XferHandle, opts: WaitOptions): Promise<void>;
  releaseXferHandle(handle: XferHandle): void;
}

export async function oneShot(
  agent: Transfers,
  op: XferOp,
  local: DescList | MemoryLike | readonly MemoryLike[],
  remote: DescList | readonly MemoryLike[] | MemoryLike,
  remoteAgent: string,
  opts: XferOptions,
): Promise<void> {
  const h = agent.initializeXfer(
    op,
    toDescList(local, opts.memType),
    toDescList(remote, opts.remoteMemType),
    remoteAgent,
    opts.notifMsg,
  );
  try {
    agent.transfer(h);
    await agent.wait(h, opts);
  } finally {
    // A wait that timed out or was aborted leaves nothing to settle: releasing rejects no one.
    if (!agent.closed) agent.releaseXferHandle(h);
  }
}
