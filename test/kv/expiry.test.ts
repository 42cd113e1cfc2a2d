// Fail closed: a decode never hands back KV that its prefill may have freed or
// reused. The puller knows until when the prefill holds a request's blocks
// (v12 remote_blocks_expiry_time through the handshake's clock offset, moved
// by the heartbeats it sent; else the profile's lease from when the prefill
// answered), refuses to start a read that cannot end in time and fails one
// that ended too late, as kind 'expired'. Through the proxy, every outcome is
// the right answer or a typed error, with prefill leases of a few hundred ms,
// decodes stalled or stopped, freed blocks poisoned at once and clocks skewed.
import type { ChildProcess } from 'node:child_process';
import { afterEach, describe, expect, it } from 'vitest';
import { exitReason, start } from '../../dist/demo/serving';
import {
  KvPuller,
  NixlAgent,
  PrefillTracker,
  PullError,
  allocate,
  buildKvTransferParams,
  servePrefill,
} from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';
import { LeaseBoard, PROBE, SLOT_BYTES, SlotState, slotOf } from '../../lib/kv/lease-board';
import { startProxy } from '../../lib/serving';
import { expectedCompletion } from '../../lib/serving/models/synthetic-kv';
import { serveTrio, tp1Layout } from '../helpers';

const BLOCK = 64 * 1024;
const BLOCKS = 16;
const quiet = { warn() {} };

const layout = (engineId: string, mem: Buffer) =>
  tp1Layout(engineId, mem, { blockLen: BLOCK, blocks: BLOCKS, regions: 1 });

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

/** A prefill whose side channel runs `skewS` seconds off this process's monotonic clock. */
async function pair(
  o: {
    skewS?: number;
    leaseMs?: number;
    delayUs?: number;
    decodeLeaseMs?: number;
    /** The side channel's clock runs this far behind the tracker's: the decode's deadline is wrong. */
    lyingClockS?: number;
    board?: boolean;
    leaseBoards?: boolean;
  } = {},
) {
  const skew = o.skewS ?? 0;
  const prefillNow = () => performance.now() + skew * 1000;
  const prefill = new NixlAgent(`exp-p-${Math.random()}`, { engine: 'loopback' });
  const decode = new NixlAgent(`exp-d-${Math.random()}`, { engine: 'loopback', testDelayUs: o.delayUs });
  const pmem = allocate(BLOCK * BLOCKS);
  for (let i = 0; i < pmem.length; i++) pmem[i] = (i * 13 + 5) & 0xff;
  const dmem = allocate(BLOCK * BLOCKS);
  prefill.registerMemory(pmem);
  decode.registerMemory(dmem);
  const board = o.board ? new LeaseBoard() : undefined;
  const server: HandshakeServer = await servePrefill({
    ranks: [{ agent: prefill, layout: layout('P', pmem), leaseBoard: board }],
    compatibilityHash: 'h',
    port: 0,
    logger: quiet,
    clock: () => prefillNow() / 1000 - (o.lyingClockS ?? 0),
  });
  const tracker = new PrefillTracker({
    agent: prefill,
    tpSize: 1,
    leaseMs: o.leaseMs ?? 30_000,
    now: prefillNow,
    logger: quiet,
    board,
  });
  const puller = new KvPuller({
    agent: decode,
    layout: layout('D', dmem),
    expectedHash: 'h',
    kvLeaseMs: o.decodeLeaseMs ?? o.leaseMs ?? 30_000,
    leaseSlackMs: 20,
    leaseBoards: o.leaseBoards,
  });
  closers.push(
    () => prefill.close(),
    () => decode.close(),
    () => server.close(),
    () => tracker.close(),
    () => puller.close(),
  );
  let n = 0;
  /** A prefilled request as vLLM's prefill would answer it: expiry on the prefill's clock. */
  const request = (blocks: number[]) => {
    const id = `req-${n++}`;
    const released = tracker.expect(id, blocks);
    const params = buildKvTransferParams(
      {
        remoteBlockIds: [blocks],
        remoteEngineId: 'P',
        remoteRequestId: id,
        remoteHost: '127.0.0.1',
        remotePort: server.basePort,
        tpSize: 1,
        remoteBlocksExpiryTime: tracker.leaseExpiry(id)! / 1000,
      },
      'v12',
    );
    return { id, params, released };
  };
  const same = (local: number, remote: number) =>
    dmem.subarray(local * BLOCK, (local + 1) * BLOCK).equals(pmem.subarray(remote * BLOCK, (remote + 1) * BLOCK));
  return { puller, tracker, dmem, request, same };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('KvPuller against the prefill lease', () => {
  for (const skewS of [0, 5, -5]) {
    it(`reads inside the lease and refuses a read after it, reading nothing (prefill clock ${skewS} s off)`, async () => {
      const p = await pair({ skewS, leaseMs: 300 });
      const a = p.request([1, 2]);
      const r = await p.puller.pullFromParams(a.params, { localBlockIds: [3, 4] });
      expect(r.bytes).toBe(2 * BLOCK);
      expect(p.same(3, 1) && p.same(4, 2)).toBe(true);
      expect((await a.released).reason).toBe('read');

      const b = p.request([5, 6]);
      await sleep(350);
      p.dmem.fill(0);
      const err = await p.puller.pullFromParams(b.params, { localBlockIds: [7, 8] }).catch((e) => e);
      expect(err).toBeInstanceOf(PullError);
      expect(err).toMatchObject({ kind: 'expired', code: 'NIXL_ERR_LEASE_EXPIRED', localBlockIds: [7, 8] });
      expect(p.dmem.every((x) => x === 0)).toBe(true); // nothing was read
      expect((await b.released).reason).toBe('expired');
      expect(p.tracker.lateReads).toBe(0); // no read was even attempted
      const s = p.puller.stats.snapshot();
      expect(s.pullsExpired).toBe(1);
      expect(s.leaseChecks).toBe(2);
      expect(s.lastLeaseLeftMs!).toBeLessThan(0);
      expect(s.lastLeaseMarginMs!).toBeGreaterThanOrEqual(20);
      expect(p.puller.stats.prometheus()).toMatch(/^nixl_node_pulls_expired_total\{\} 1$/m);
    });
  }

  it('a read that ends after the lease (its heartbeats lost) fails as expired, never as success', async () => {
    // Each transfer takes 300 ms in the engine; the lease has 150 ms left and
    // no heartbeat goes out in time to move it (the decode's lease setting
    // spaces them 5 s apart: as if they were lost).
    const p = await pair({ leaseMs: 150, delayUs: 300_000, decodeLeaseMs: 30_000 });
    const a = p.request([1]);
    const err = await p.puller.pullFromParams(a.params, { localBlockIds: [2] }).catch((e) => e);
    expect(err).toMatchObject({ kind: 'expired', code: 'NIXL_ERR_LEASE_EXPIRED', localBlockIds: [2] });
    expect(String(err.message)).toMatch(/may have been reused/);
    // The prefill saw the read come after the lease: it counts it.
    await expect.poll(() => p.tracker.lateReads, { timeout: 3000 }).toBe(1);
  });

  it("the prefill's lease board fails a read the decode's own (wrong) clock would have trusted", async () => {
    // The side channel's clock lags the tracker's by 10 s: the decode maps the
    // expiry 10 s too late and believes the lease has long to run.
    for (const leaseBoards of [true, false]) {
      const p = await pair({ leaseMs: 200, lyingClockS: 10, board: true, leaseBoards, decodeLeaseMs: 30_000 });
      const fresh = p.request([1]);
      expect((await p.puller.pullFromParams(fresh.params, { localBlockIds: [2] })).bytes).toBe(BLOCK);
      expect((await fresh.released).reason).toBe('read');
      const stale = p.request([3]);
      expect((await stale.released).reason).toBe('expired'); // the prefill freed it
      const out = await p.puller.pullFromParams(stale.params, { localBlockIds: [4] }).catch((e) => e);
      if (leaseBoards) {
        expect(out).toMatchObject({ kind: 'expired', code: 'NIXL_ERR_LEASE_EXPIRED' });
        expect(String(out.message)).toMatch(/no longer held .*its lease ran out/);
        // Nothing was announced as read: the prefill saw no late read either.
        expect(p.tracker.lateReads).toBe(0);
      } else {
        // Without the board the decode's clock is all it has: it trusts freed blocks.
        expect(out.bytes).toBe(BLOCK);
        await expect.poll(() => p.tracker.lateReads).toBe(1);
      }
    }
  });

  it('a board with no free slot for a request fails its reads closed', async () => {
    const p = await pair({ board: true });
    const board = p.tracker.board as LeaseBoard;
    // Hold every slot the request could use with other requests.
    const { first } = slotOf('req-0', board.slots);
    let held = 0;
    for (let n = 0; held < PROBE; n++) {
      const f = slotOf(`other-${n}`, board.slots).first;
      if (f >= first - PROBE && f <= first && board.hold(`other-${n}`)) held = countHeld(board, first);
      if (n > 2_000_000) throw new Error('no ids for those slots');
    }
    const a = p.request([1]);
    expect(a.id).toBe('req-0');
    const err = await p.puller.pullFromParams(a.params, { localBlockIds: [2] }).catch((e) => e);
    expect(err).toMatchObject({ kind: 'expired' });
    expect(String(err.message)).toMatch(/not on its lease board/);
  }, 60_000);

  it('heartbeats this decode sent move its deadline as they move the prefill lease', async () => {
    // Lease 300 ms, heartbeats every 50 ms; each transfer takes 200 ms on the
    // agent's one engine thread, so the second ends ~400 ms after its prefill
    // answered: past the first deadline, inside the one the heartbeats made.
    const p = await pair({ leaseMs: 300, delayUs: 200_000 });
    const a = p.request([1]);
    const b = p.request([2]);
    const [ra, rb] = await Promise.all([
      p.puller.pullFromParams(a.params, { localBlockIds: [3] }),
      p.puller.pullFromParams(b.params, { localBlockIds: [4] }),
    ]);
    expect(ra.bytes + rb.bytes).toBe(2 * BLOCK);
    expect(p.same(3, 1) && p.same(4, 2)).toBe(true);
    expect(p.puller.heartbeatsSent).toBeGreaterThan(0);
    expect(p.tracker.lateReads).toBe(0);
  });
});

// ---- through the proxy --------------------------------------------------------

interface Tally {
  right: number;
  typed: number;
  wrong: string[];
}

async function ask(url: string, i: number, tally: Tally): Promise<void> {
  const prompt = `request ${i}: the quick brown fox jumps over the lazy dog ${'x'.repeat(i * 7)}`;
  const r = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt, max_tokens: 8 }),
  });
  const j = (await r.json()) as { choices?: Array<{ text: string }>; error?: { message: string; type: string } };
  if (r.ok) {
    if (j.choices?.[0]?.text === expectedCompletion(prompt, 8).join(' ')) tally.right++;
    else tally.wrong.push(JSON.stringify(j).slice(0, 200));
  } else if (r.status >= 500 && j.error?.type === 'stage_failed') tally.typed++;
  else tally.wrong.push(`${r.status} ${JSON.stringify(j).slice(0, 200)}`);
}

describe('through the proxy: a right answer or a typed error, never stale KV', () => {
  for (const [transport, skew] of [
    ['http', 0],
    ['zmq', 3000],
    ['http', -3000],
  ] as const) {
    it(`prefill lease 200 ms, decode stalled 1 s, freed blocks poisoned at once (${transport}, prefill clock ${skew} ms off)`, async () => {
      const { prefill, decode, proxy } = await serveTrio(closers, {
        transport,
        prefill: { blocks: 48, leaseMs: 200, testHooks: { poisonFreed: true, clockSkewMs: skew } },
        decode: { blocks: 256, testHooks: { stallDecodeMs: 1000 } },
      });
      const tally: Tally = { right: 0, typed: 0, wrong: [] };
      const first = Array.from({ length: 6 }, (_, i) => ask(proxy.url, i, tally));
      await sleep(450);
      // These get the blocks the first six's leases freed (and poisoned).
      const second = Array.from({ length: 6 }, (_, i) => ask(proxy.url, 6 + i, tally));
      await Promise.all([...first, ...second]);
      expect(tally.wrong).toEqual([]);
      expect(tally.right + tally.typed).toBe(12);
      // The decode refused every read that could not end inside its lease: it
      // never read a poisoned (reused) block.
      expect(decode.stats.badBytes).toBe(0);
      expect(decode.stats.pullsExpired).toBeGreaterThan(0);
      // Each expired request was prefilled once more before giving up.
      expect(proxy.stats.expiredRetries).toBeGreaterThan(0);
      await expect.poll(() => prefill.freeBlocks, { timeout: 3000 }).toBe(48);
    }, 30_000);
  }

  it('a lease long enough for the pulls: every answer right, nothing expired', async () => {
    const { prefill, decode, proxy } = await serveTrio(closers, {
      prefill: { blocks: 512, leaseMs: 10_000, testHooks: { poisonFreed: true } },
      decode: { blocks: 256 },
    });
    const tally: Tally = { right: 0, typed: 0, wrong: [] };
    await Promise.all(Array.from({ length: 20 }, (_, i) => ask(proxy.url, i, tally)));
    expect(tally).toEqual({ right: 20, typed: 0, wrong: [] });
    expect(decode.stats.pullsExpired).toBe(0);
    expect(prefill.stats.lateReads).toBe(0);
  });
});

describe('processes stopped mid-request (SIGSTOP)', () => {
  it('a decode stopped past the lease, then resumed: right answers or typed errors, counted in its stats', async () => {
    const procs: ChildProcess[] = [];
    closers.push(() => {
      for (const p of procs) if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
    });
    const spawned = (p: ChildProcess) => procs.push(p);
    const pre = await start(['worker', '--blocks', '48', '--lease-ms', '300', '--poison-freed'], spawned);
    const dec = await start(['worker', '--blocks', '256', '--stall-decode-ms', '50'], spawned);
    const proxy = await startProxy({
      prefill: [String(pre.ready.address)],
      decode: [String(dec.ready.address)],
      healthIntervalMs: 0,
      prefillRetries: 0,
    });
    closers.push(() => proxy.close());
    const tally: Tally = { right: 0, typed: 0, wrong: [] };
    const all: Array<Promise<void>> = [];
    for (let round = 0; round < 4; round++) {
      for (let i = 0; i < 4; i++) all.push(ask(proxy.url, round * 4 + i, tally));
      await sleep(20);
      // Stopped during its stall or its pull, for longer than the lease.
      dec.p.kill('SIGSTOP');
      await sleep(500);
      dec.p.kill('SIGCONT');
      await sleep(100);
    }
    await Promise.all(all);
    expect(tally.wrong).toEqual([]);
    expect(tally.right + tally.typed).toBe(16);
    // Its stats on request: refused or failed pulls counted as expired, no stale byte read.
    const statsLine = new Promise<Record<string, number>>((resolve) => {
      const t = setInterval(() => {
        const l = dec.lines.find((x) => x.stats);
        if (l) {
          clearInterval(t);
          resolve(l.stats as Record<string, number>);
        }
      }, 20);
    });
    dec.p.kill('SIGUSR2');
    const stats = await statsLine;
    expect(stats.badBytes).toBe(0);
    expect(stats.pullsExpired).toBeGreaterThan(0);
    expect(dec.death(), exitReason(dec.p.exitCode, dec.p.signalCode)).toBeUndefined();
  }, 40_000);
});

/** How many of the PROBE slots from `first` are held. */
function countHeld(board: LeaseBoard, first: number): number {
  let n = 0;
  for (let i = 0; i < PROBE; i++)
    if (board.mem.readBigUInt64LE((first + i) * SLOT_BYTES + 8) === BigInt(SlotState.HELD)) n++;
  return n;
}
