// One push of one offered request: handshake back to the decode its first
// registration names, then one WRITE into each decode rank this rank maps to,
// into the blocks THAT rank registered, once it registered; then settle the
// offer. Never retried. No WRITE after the lease or the decode's deadline; a
// nixl-node decode rank (nixl_node_confirm) is told only after its WRITE
// completed while the blocks were still held.
import type { NixlAgent, XferHandle } from '../../agent';
import { NixlError } from '../../errors';
import type { HandshakeLogger } from '../../handshake/types';
import { blockDescIds, regionCounts } from '../descs';
import type { RemoteEndpoint, RemoteEngine } from '../engine-connect';
import type { KvLayout } from '../layout';
import { expandTail } from '../limits';
import type { LocalDlists } from '../local-dlists';
import type { PeerEngines } from '../peers';
import { expand } from '../pull/params';
import type { KvStats } from '../stats';
import type { Offer } from './offers';
import { type ReceivedReg, decodeKey, sameRegistration } from './pairing';
import type { Refusals } from './refusals';
import { writeNotif } from './reg';
import type { PushSenderStats } from './types';

/** What every push of one sender shares. @internal */
export interface PushDeps {
  agent: NixlAgent;
  layout: KvLayout;
  engines: PeerEngines;
  local: LocalDlists;
  refusals: Refusals;
  stats: PushSenderStats;
  log: HandshakeLogger;
  /** No WRITE closer than this to the lease end or the decode's deadline, ms. */
  marginMs: number;
  transferStats?: KvStats;
  /** Transfer handles held by every push of the sender. */
  handles: Set<XferHandle>;
}

interface Posted {
  h: XferHandle;
  /** The decode rank (agent) written. */
  to: string;
  /** The WRITE completed (and its rank was confirmed). */
  done: Promise<void>;
}

/**
 * Pushes offer `o` to the decode `regs` name (the first one decides which);
 * later ranks' registrations arrive in `o.regs` (and wake it). A rank
 * registering other blocks than the first registration is refused (no WRITE
 * to it, and none after); a rank not registered by the lease end or the
 * decode's deadline is never written: the push fails, ranks already written
 * hold correct bytes. @internal
 */
export async function pushOffer(d: PushDeps, o: Offer, regs: ReceivedReg[]): Promise<void> {
  const first = regs[0];
  o.decode = decodeKey(first);
  for (const r of regs) o.regs.set(r.from, r);
  const posted: Posted[] = [];
  const sent = { bytes: 0, ranks: new Set<string>() as ReadonlySet<string> };
  let err: unknown;
  try {
    await writeRanks(d, o, first, posted, sent);
  } catch (e) {
    err = e;
  }
  await finish(d, o, first, posted, sent, err);
}

/** Handshakes back to the decode, then WRITEs each of its ranks this rank maps to as each registers. */
async function writeRanks(
  d: PushDeps,
  o: Offer,
  first: ReceivedReg,
  posted: Posted[],
  sent: { bytes: number; ranks: ReadonlySet<string> },
): Promise<void> {
  const { reg } = first;
  const ep: RemoteEndpoint = {
    host: reg.decodeHost,
    port: reg.decodePort,
    tpSize: reg.decodeTpSize,
    engineId: reg.decodeEngineId,
  };
  const engine = await d.engines.get(ep);
  if (o.settled) return;
  const targets = new Map(engine.reads.map((p) => [p.rank.agentName, p]));
  /** The decode's ranks this rank writes (a refusal goes only to them). */
  sent.ranks = new Set(targets.keys());
  if (!targets.has(first.from))
    throw new NixlError(
      `the registration came from agent '${first.from}', which is not a rank of decode '${reg.decodeEngineId}' at ${reg.decodeHost}:${reg.decodePort} this rank writes`,
      'NIXL_ERR_NOT_ALLOWED',
    );
  const notif = writeNotif(reg.requestId, d.layout.tpSize);
  for (;;) {
    for (const [name, p] of targets) {
      const r = o.regs.get(name);
      if (!r) continue;
      targets.delete(name);
      agree(d, first, r);
      if (p.read.notifyOnly)
        throw new NixlError(
          'push to an MLA decode of larger TP is not supported by nixl-node',
          'NIXL_ERR_NOT_SUPPORTED',
        );
      const { local, remote } = blockIds(d, engine, o, r.reg.localBlockIds[0]);
      checkTime(d, o, r);
      const t0 = performance.now();
      const localDescs = blockDescIds(regionCounts(p.read.local.length, d.layout.numBlocks), local);
      const x = post(d, posted, name, () =>
        d.agent.makePreppedXfer(
          'WRITE',
          d.local.get(p.read),
          localDescs,
          p.rank.dlist,
          blockDescIds(p.rank.counts, remote),
          r.reg.confirm ? undefined : notif,
        ),
      );
      const size = { bytes: p.blockBytes * local.length, descriptors: localDescs.length };
      x.done = timed(d, written(d, o, x.h, r.reg.confirm ? name : undefined, notif), t0, size);
      sent.bytes += size.bytes;
    }
    if (!targets.size) break;
    await nextReg(d, o, first, [...targets.keys()]);
    if (o.settled) break;
  }
}

/** Waits for the posted WRITEs (held through them), tells ranks not written why, settles. */
async function finish(
  d: PushDeps,
  o: Offer,
  first: ReceivedReg,
  posted: Posted[],
  sent: { bytes: number; ranks: ReadonlySet<string> },
  failure: unknown,
): Promise<void> {
  const { reg } = first;
  let err = failure;
  try {
    if (o.settled) return;
    const done = await Promise.allSettled(posted.map((x) => x.done));
    err ??= done.find((r) => r.status === 'rejected')?.reason;
    if (o.settled) return;
    if (err === undefined) {
      d.stats.bytes += sent.bytes;
      o.settle({ reason: 'written', decodeRequestId: reg.requestId, bytes: sent.bytes, writes: posted.length });
      return;
    }
    const e = err instanceof NixlError ? err : new NixlError(String(err), 'NIXL_ERR_UNKNOWN');
    d.log.warn(`push of '${o.requestId}' to '${reg.requestId}' failed (not retried): ${e.message}`);
    // A nixl-node decode rank not written would otherwise wait out its deadline for a notification that cannot come.
    const wrote = new Set(posted.filter((_, i) => done[i]?.status === 'fulfilled').map((x) => x.to));
    for (const [name, r] of o.regs) if (sent.ranks.has(name) && !wrote.has(name)) d.refusals.tell(r, e);
    o.settle({ reason: 'failed', decodeRequestId: reg.requestId, bytes: 0, writes: posted.length, error: e });
  } finally {
    for (const { h } of posted) {
      d.handles.delete(h);
      try {
        d.agent.releaseXferHandle(h);
      } catch {
        /* agent closed */
      }
    }
  }
}

/**
 * Makes and posts one WRITE. WRITEs are counted in the transfer stats
 * (transferStats), as vLLM's push prefill counts them (the side that posts
 * a transfer records it): one that fails to post or to complete is a failed
 * transfer; one done, its post time, time to completion, bytes, descriptors.
 */
function post(d: PushDeps, posted: Posted[], to: string, make: () => XferHandle): Posted {
  try {
    const x: Posted = { h: make(), to, done: Promise.resolve() };
    posted.push(x);
    d.handles.add(x.h);
    d.agent.transfer(x.h);
    return x;
  } catch (e) {
    d.transferStats?.recordFailedTransfer();
    throw e;
  }
}

/** The WRITE posted at t0 (see post) ending in `done`: counted, its post time being until now. */
async function timed(
  d: PushDeps,
  done: Promise<void>,
  t0: number,
  size: { bytes: number; descriptors: number },
): Promise<void> {
  const stats = d.transferStats;
  const postMs = performance.now() - t0;
  try {
    await done;
  } catch (e) {
    stats?.recordFailedTransfer();
    throw e;
  }
  stats?.recordTransfer(size.bytes, size.descriptors, postMs, performance.now() - t0 - postMs);
}

/** One WRITE done; a nixl-node rank (confirm) is told only now, while the blocks are still held. */
async function written(d: PushDeps, o: Offer, h: XferHandle, confirmTo: string | undefined, notif: string) {
  await d.agent.wait(h, { timeoutMs: Math.max(1, o.leaseEnd - performance.now()) });
  // Held through the WRITE (the lease did not end under it): only now is the KV the decode's.
  if (confirmTo !== undefined && !o.settled) d.agent.sendNotif(confirmTo, notif);
}

/** A rank's registration must name the blocks (and decode) the request's first one names. */
function agree(d: PushDeps, first: ReceivedReg, r: ReceivedReg): void {
  if (sameRegistration(first.reg, r.reg)) return;
  d.stats.mismatched++;
  throw new NixlError(
    `decode rank '${r.from}' registered ${r.reg.localBlockIds[0].length} blocks for '${r.reg.requestId}' that disagree with rank '${first.from}''s ${first.reg.localBlockIds[0].length} (or another decode address): '${r.from}' is not written`,
    'NIXL_ERR_INVALID_PARAM',
  );
}

/** Waits for another decode rank's registration, bounded by the lease and the decode's deadline. */
async function nextReg(d: PushDeps, o: Offer, first: ReceivedReg, missing: string[]): Promise<void> {
  const bound = Math.min(o.leaseEnd, first.deadlineAt) - d.marginMs;
  const wait = bound - performance.now();
  if (wait <= 0)
    throw new NixlError(
      `decode rank(s) ${missing.join(', ')} never registered '${first.reg.requestId}' with this rank in time: not written`,
      'NIXL_ERR_TIMEOUT',
    );
  await new Promise<void>((resolve) => {
    const t = setTimeout(resolve, Math.min(wait, 2 ** 31 - 1));
    o.wake = () => {
      clearTimeout(t);
      o.wake = undefined;
      resolve();
    };
  });
}

/** Neither the lease nor the decode's deadline may end before the WRITE could. */
function checkTime(d: PushDeps, o: Offer, r: ReceivedReg): void {
  const now = performance.now();
  if (o.settled || now + d.marginMs >= o.leaseEnd)
    throw new NixlError(`the lease on '${o.requestId}' is over: no WRITE after it`, 'NIXL_ERR_LEASE_EXPIRED');
  if (now + d.marginMs >= r.deadlineAt)
    throw new NixlError(`decode '${r.reg.requestId}' has given up (its deadline passed): no WRITE`, 'NIXL_ERR_TIMEOUT');
}

/**
 * Our kernel ids, end-trimmed to the decode's count (a prefix hit on the
 * decode registers fewer), and the decode's, checked against what its
 * ranks hold. The decode asking for more blocks than we have is refused,
 * and for fewer when the offer is exact (a truncated whole is no KV).
 */
function blockIds(
  d: PushDeps,
  engine: RemoteEngine,
  o: Offer,
  theirs: number[],
): { local: number[]; remote: number[] } {
  const ours = o.blockIds;
  if (o.exact && theirs.length !== ours.length)
    throw new NixlError(
      `the decode registered ${theirs.length} blocks, this request's KV is one whole of ${ours.length}: refused, nothing written (prompts differ?)`,
      'NIXL_ERR_MISMATCH',
    );
  if (theirs.length > ours.length)
    throw new NixlError(
      `the decode registered ${theirs.length} blocks, this request has ${ours.length}: refused (prompts differ?)`,
      'NIXL_ERR_INVALID_PARAM',
    );
  const dRatio = engine.physicalBlocksPerLogical;
  const nRemote = Math.min(...[...engine.ranks.values()].flatMap((x) => x.counts));
  const remote = expandTail(theirs, dRatio, theirs.length * dRatio, nRemote, 'registered block ids');
  const local = expand(ours.slice(ours.length - theirs.length), d.layout.physicalBlocksPerLogical ?? 1);
  if (local.length !== remote.length)
    throw new NixlError(
      `kernel blocks differ: ${local.length} here, ${remote.length} on the decode (physical blocks per logical differ)`,
      'NIXL_ERR_NOT_SUPPORTED',
    );
  return { local, remote };
}
