// Push under heterogeneous TP on the loopback engine, mapped as vLLM maps it
// (seen from the prefill: rank p writes decode rank p // (P_tp / D_tp) its
// head slice, or, with fewer prefill ranks, each decode rank p * k + i its
// chunk), and each decode rank counting pp x max(1, P_tp // D_tp) WRITEs.
import { afterEach, describe, expect, it } from 'vitest';
import { KvPushReceiver, KvPushSender, NixlAgent, allocate, servePrefill } from '../../lib';
import type { HandshakeServer } from '../../lib/handshake';
import { ENGINE, BLOCK, BLOCKS, PUSH_HASH, REGIONS, blockOf, fill, quiet, rankLayout } from './push-helpers';

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of closers.splice(0).reverse()) await c();
});

interface Rank {
  agent: NixlAgent;
  mem: Buffer;
  layout: ReturnType<typeof rankLayout>;
}

function ranks(engine: string, tp: number, len: number, seed?: number): Rank[] {
  return Array.from({ length: tp }, (_, r) => {
    const agent = new NixlAgent(`${engine.toLowerCase()}-tp${tp}-${r}`, { engine: ENGINE });
    const mem = allocate(REGIONS * BLOCKS * len);
    if (seed === undefined) mem.fill(0);
    else fill(mem, seed + r);
    agent.registerMemory(mem);
    closers.push(() => agent.close());
    return { agent, mem, layout: rankLayout(engine, mem, tp, r, len) };
  });
}

async function serve(rs: Rank[]): Promise<HandshakeServer> {
  const s = await servePrefill({
    ranks: rs.map((r) => ({ agent: r.agent, layout: r.layout })),
    compatibilityHash: PUSH_HASH,
    port: 0,
  });
  closers.push(() => s.close());
  return s;
}

async function setup(pTp: number, dTp: number) {
  const ps = ranks('P', pTp, (BLOCK * 2) / pTp, 7);
  const ds = ranks('D', dTp, (BLOCK * 2) / dTp);
  const pServer = await serve(ps);
  const dServer = await serve(ds);
  const senders = ps.map(
    (p) => new KvPushSender({ agent: p.agent, layout: p.layout, expectedHash: PUSH_HASH, logger: quiet }),
  );
  const receivers = ds.map(
    (d) =>
      new KvPushReceiver({
        agent: d.agent,
        layout: d.layout,
        decodeHost: '127.0.0.1',
        decodePort: dServer.basePort,
        expectedHash: PUSH_HASH,
        timeoutMs: 5000,
      }),
  );
  for (const x of [...senders, ...receivers]) closers.push(() => x.close());
  const params = {
    do_remote_prefill: true,
    remote_engine_id: 'P',
    remote_request_id: 'u',
    remote_host: '127.0.0.1',
    remote_port: pServer.basePort,
    tp_size: pTp,
    pp_size: 1,
  };
  return { ps, ds, senders, receivers, params };
}

describe('push with heterogeneous TP', () => {
  it('P_tp 2 -> D_tp 1: each prefill rank writes its head slice; the decode counts 2 WRITEs', async () => {
    const { ps, ds, senders, receivers, params } = await setup(2, 1);
    const got = receivers[0].receive(params, { requestId: 'h21', localBlockIds: [4, 5] });
    const sent = await Promise.all(senders.map((s) => s.offer('h21', [1, 2])));
    const r = await got;
    expect(r.notifications).toBe(2);
    expect(r.writers.sort()).toEqual(['p-tp2-0', 'p-tp2-1']);
    expect(sent.map((s) => s.reason)).toEqual(['written', 'written']);
    const half = BLOCK;
    for (let reg = 0; reg < REGIONS; reg++)
      for (const [p, d] of [
        [1, 4],
        [2, 5],
      ]) {
        const want = Buffer.concat([blockOf(ps[0].mem, reg, p, half), blockOf(ps[1].mem, reg, p, half)]);
        expect(blockOf(ds[0].mem, reg, d, 2 * BLOCK).equals(want)).toBe(true);
      }
  });

  it('P_tp 1 -> D_tp 2: one push, each decode rank written after its own registration, its chunk', async () => {
    const { ps, ds, senders, receivers, params } = await setup(1, 2);
    const got = receivers.map((rcv) => rcv.receive(params, { requestId: 'h12', localBlockIds: [3] }));
    await new Promise((r) => setTimeout(r, 100));
    const sent = await senders[0].offer('h12', [6]);
    const rs = await Promise.all(got);
    expect(rs.map((r) => r.notifications)).toEqual([1, 1]);
    expect(sent).toMatchObject({ reason: 'written', writes: 2 });
    expect(senders[0].stats).toMatchObject({ duplicates: 0, mismatched: 0 });
    const whole = 2 * BLOCK;
    for (let reg = 0; reg < REGIONS; reg++) {
      const src = blockOf(ps[0].mem, reg, 6, whole);
      expect(blockOf(ds[0].mem, reg, 3, BLOCK).equals(src.subarray(0, BLOCK))).toBe(true);
      expect(blockOf(ds[1].mem, reg, 3, BLOCK).equals(src.subarray(BLOCK))).toBe(true);
    }
  });

  it('P_tp 4 -> D_tp 2: each decode rank registers with its two prefill ranks and counts 2 WRITEs', async () => {
    const { ps, ds, senders, receivers, params } = await setup(4, 2);
    const got = receivers.map((rcv) => rcv.receive(params, { requestId: 'h42', localBlockIds: [9] }));
    const sent = await Promise.all(senders.map((s) => s.offer('h42', [2])));
    const rs = await Promise.all(got);
    expect(rs.map((r) => r.notifications)).toEqual([2, 2]);
    expect(sent.every((s) => s.reason === 'written' && s.writes === 1)).toBe(true);
    const q = BLOCK / 2;
    for (let reg = 0; reg < REGIONS; reg++)
      for (let d = 0; d < 2; d++) {
        const want = Buffer.concat([blockOf(ps[2 * d].mem, reg, 2, q), blockOf(ps[2 * d + 1].mem, reg, 2, q)]);
        expect(blockOf(ds[d].mem, reg, 9, BLOCK).equals(want)).toBe(true);
      }
  });
});

describe('push with decode TP > prefill TP: each decode rank only into the blocks it registered', () => {
  const zero = (m: Buffer, b: number) => [0, 1].every((reg) => blockOf(m, reg, b, BLOCK).every((x) => x === 0));

  it("ranks registering different block ids: the disagreeing rank is not written (typed, counted), never with another rank's ids", async () => {
    const { ds, senders, receivers, params } = await setup(1, 2);
    const got0 = receivers[0].receive(params, { requestId: 'mis', localBlockIds: [1, 2], timeoutMs: 3000 });
    await new Promise((r) => setTimeout(r, 50));
    const got1 = receivers[1]
      .receive(params, { requestId: 'mis', localBlockIds: [5, 6], timeoutMs: 60_000 })
      .catch((e: unknown) => e);
    await new Promise((r) => setTimeout(r, 50));
    const sent = await senders[0].offer('mis', [3, 4]);
    expect((await got0).notifications).toBe(1);
    // The rank not written is told at once (the written one is not: it completed).
    expect(await got1).toMatchObject({ kind: 'refused', code: 'NIXL_ERR_INVALID_PARAM' });
    expect(sent).toMatchObject({ reason: 'failed', writes: 1, error: { code: 'NIXL_ERR_INVALID_PARAM' } });
    expect(senders[0].stats).toMatchObject({ mismatched: 1, failed: 1, duplicates: 0 });
    for (const b of [1, 2, 5, 6]) expect(zero(ds[1].mem, b)).toBe(true);
    expect(zero(ds[0].mem, 1) || zero(ds[0].mem, 2)).toBe(false);
  });

  it('a rank that registers later is written only after it registered, into its own ids', async () => {
    const { ps, ds, senders, receivers, params } = await setup(1, 2);
    const got0 = receivers[0].receive(params, { requestId: 'late', localBlockIds: [7], timeoutMs: 3000 });
    const sent = senders[0].offer('late', [6]);
    await got0;
    await new Promise((r) => setTimeout(r, 100));
    for (const reg of [0, 1]) expect(blockOf(ds[1].mem, reg, 7, BLOCK).every((x) => x === 0)).toBe(true);
    const r1 = await receivers[1].receive(params, { requestId: 'late', localBlockIds: [7], timeoutMs: 3000 });
    expect(r1.notifications).toBe(1);
    expect(await sent).toMatchObject({ reason: 'written', writes: 2 });
    for (let reg = 0; reg < REGIONS; reg++)
      expect(blockOf(ds[1].mem, reg, 7, BLOCK).equals(blockOf(ps[0].mem, reg, 6, 2 * BLOCK).subarray(BLOCK))).toBe(
        true,
      );
  });

  it('a rank whose registration never comes is not written; the others are, and the push fails by the deadline', async () => {
    const { ds, senders, receivers, params } = await setup(1, 2);
    const sent = senders[0].offer('gone', [6]);
    const r0 = await receivers[0].receive(params, { requestId: 'gone', localBlockIds: [2], timeoutMs: 400 });
    expect(r0.notifications).toBe(1);
    expect(await sent).toMatchObject({ reason: 'failed', writes: 1, error: { code: 'NIXL_ERR_TIMEOUT' } });
    expect(zero(ds[1].mem, 2)).toBe(true);
    expect(senders[0].resources()).toMatchObject({ offers: 0, xferHandles: 0 });
  });
});
