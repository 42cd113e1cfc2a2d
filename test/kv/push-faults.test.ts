// Push mode's faults and hostile input on the loopback engine: a decode that
// dies after registering, a prefill that dies before or during its WRITE,
// late WRITEs and quarantine, duplicate / forged / malformed / oversized
// registrations, signed registrations, and pull and push peers meeting.
import { afterEach, describe, expect, it } from 'vitest';
import {
  KvPuller,
  KvPushReceiver,
  NixlAgent,
  PullError,
  PushError,
  TransferModeError,
  computeCompatibilityHash,
  servePrefill,
} from '../../lib';
import { packMsgpack } from '../../lib/handshake/msgpack';
import { PUSH_REG_PREFIX, encodePushReg, type PushRegistration } from '../../lib/kv/push/reg';
import { PUSH_REFUSED_PREFIX, encodeRefusal } from '../../lib/kv/push/reg';
import { ENGINE, PushPair, rankLayout } from './push-helpers';

const pairs: PushPair[] = [];
const start = async (o?: Parameters<typeof PushPair.start>[0]) => {
  const t = await PushPair.start(o);
  pairs.push(t);
  return t;
};
afterEach(async () => {
  for (const t of pairs.splice(0)) await t.close();
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
async function until(f: () => boolean, ms = 2000): Promise<void> {
  const t0 = performance.now();
  while (!f()) {
    if (performance.now() - t0 > ms) throw new Error('condition not reached');
    await sleep(5);
  }
}

function reg(t: PushPair, o: Partial<PushRegistration> = {}): PushRegistration {
  return {
    requestId: 'r',
    decodeEngineId: 'D',
    decodeHost: '127.0.0.1',
    decodePort: t.dServer.basePort,
    decodeTpSize: 1,
    localBlockIds: [[1, 2]],
    remoteEngineId: 'P',
    remoteHost: '127.0.0.1',
    remotePort: t.pServer.basePort,
    remoteTpSize: 1,
    remotePpSize: 1,
    ...o,
  };
}

describe('push faults', () => {
  it('a decode that dies after registering: the push fails once, is not retried, and the blocks are freed', async () => {
    const t = await start({ sender: { handshakeTimeoutMs: 100, leaseMs: 3000 } });
    const got = t.receiver
      .receive(t.params(), { requestId: 'dies', localBlockIds: [1, 2], timeoutMs: 400 })
      .catch((e: unknown) => e);
    await until(() => t.sender.pending.registrations === 1);
    await t.dServer.close();
    t.dAgent.close();
    const t0 = performance.now();
    const sent = await t.sender.offer('dies', [3, 4]);
    // Freed once the handshake back failed (well before the 3 s lease), not retried.
    expect(performance.now() - t0).toBeLessThan(2500);
    expect(sent).toMatchObject({ reason: 'failed', writes: 0 });
    expect(sent.error?.message).toMatch(/handshake|connect|timed out|refused/i);
    expect(await got).toBeInstanceOf(PushError);
    await sleep(100);
    expect(t.sender.stats).toMatchObject({ failed: 1, written: 0 });
    expect(t.sender.resources()).toMatchObject({ offers: 0, registrations: 0, xferHandles: 0, engines: 0 });
  });

  it('a request no decode registers for is freed at its lease', async () => {
    const t = await start({ sender: { leaseMs: 200 } });
    const t0 = performance.now();
    const sent = await t.sender.offer('nobody', [1]);
    const held = performance.now() - t0;
    expect(sent.reason).toBe('expired');
    expect(held).toBeGreaterThanOrEqual(199);
    expect(held).toBeLessThan(1500);
  });

  it('a prefill that dies before its WRITE: the decode fails typed once its probe finds it gone, not at its deadline, and quarantines its blocks', async () => {
    const t = await start({ receiver: { quarantineMs: 300 } });
    const t0 = performance.now();
    const deadline = 20_000;
    const got = t.receiver
      .receive(t.params(), { requestId: 'p-dies', localBlockIds: [4, 5], timeoutMs: deadline })
      .catch((e: unknown) => e);
    await until(() => t.sender.pending.registrations === 1);
    await t.sender.close();
    t.pAgent.close();
    const err = (await got) as PushError;
    const took = performance.now() - t0;
    expect(err).toBeInstanceOf(PushError);
    if (process.env.NIXL_NODE_ENGINE === 'nixl' && err.kind === 'timeout') {
      // UCX with ucx_error_handling_mode=none (what shared memory needs) never reports a closed peer: the
      // deadline is what tells (docs/nixl.md). Over TCP in peer mode the probe finds it (push-nixl-ucx-mode).
      expect(took).toBeGreaterThanOrEqual(deadline - 50);
    } else {
      expect(err).toMatchObject({ kind: 'peer-gone', code: 'NIXL_ERR_REMOTE_DISCONNECT', localBlockIds: [4, 5] });
      expect(err.message).toMatch(/prefill agent 'push-p' cannot be reached since the registration/);
      expect(took).toBeLessThan(deadline / 2);
    }
    expect(err.quarantinedUntilMs).toBeGreaterThan(performance.now());
    expect(t.receiver.quarantine.held([3, 4, 5, 6])).toEqual([4, 5]);
    // The blocks, and the id, are refused while a WRITE could still land.
    const again = await t.receiver
      .receive(t.params(), { requestId: 'other', localBlockIds: [5], timeoutMs: 100 })
      .catch((e: unknown) => e);
    expect(again).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_NOT_ALLOWED' });
    expect((again as Error).message).toMatch(/quarantine/);
    const sameId = await t.receiver
      .receive(t.params(), { requestId: 'p-dies', localBlockIds: [9], timeoutMs: 100 })
      .catch((e: unknown) => e);
    expect(sameId).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_NOT_ALLOWED' });
    await t.receiver.quarantine.drained();
    expect(performance.now()).toBeGreaterThanOrEqual(err.quarantinedUntilMs!);
    expect(t.receiver.quarantine.held([4, 5])).toEqual([]);
  });

  it('a WRITE after the deadline: a nixl-node prefill does not post it; a late notification settles nothing newer', async () => {
    const t = await start();
    const err = await t.receiver
      .receive(t.params(), { requestId: 'late', localBlockIds: [1], timeoutMs: 150 })
      .catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: 'timeout' });
    // The registration reached the prefill before its request finished (case A); its deadline has passed: dropped.
    expect(t.sender.pending.registrations).toBe(0);
    const sent = t.sender.offer('late', [7]);
    expect(t.sender.abort('late')).toBe(true);
    expect((await sent).reason).toBe('aborted');
    expect(t.untouched()).toBe(true);
    // One full push, so that the prefill's agent knows the decode's.
    const warm = t.receiver.receive(t.params(), { requestId: 'warm', localBlockIds: [3] });
    await t.sender.offer('warm', [6]);
    await warm;
    // A stale "late:1" (a vLLM prefill's deferred WRITE) is counted late and settles no newer receive.
    const newer = t.receiver.receive(t.params(), { requestId: 'newer', localBlockIds: [2], timeoutMs: 2000 });
    await until(() => t.sender.pending.registrations === 1);
    t.pAgent.sendNotif('push-d', 'late:1');
    await until(() => t.receiver.lateWrites === 1);
    expect(t.receiver.resources().receiving).toBe(1);
    const off = t.sender.offer('newer', [8]);
    expect(await newer).toMatchObject({ requestId: 'newer', notifications: 1 });
    expect((await off).reason).toBe('written');
    expect(t.same([8], [2])).toBe(true);
  });

  it('notifications from an agent we did not register with prove nothing; another prefill TP size fails the receive', async () => {
    const t = await start();
    const rogue = new NixlAgent('rogue0', { engine: ENGINE });
    try {
      const warm = t.receiver.receive(t.params(), { requestId: 'warm', localBlockIds: [3] });
      await t.sender.offer('warm', [6]);
      await warm;
      rogue.addRemoteAgent(t.dAgent.getAgentMetadata());
      const got = t.receiver
        .receive(t.params(), { requestId: 'tp', localBlockIds: [1], timeoutMs: 2000 })
        .catch((e: unknown) => e);
      await until(() => t.sender.pending.registrations === 1);
      rogue.sendNotif('push-d', 'tp:1');
      await until(() => t.receiver.unrecognized === 1);
      expect(t.receiver.resources().receiving).toBe(1);
      t.pAgent.sendNotif('push-d', 'tp:2');
      expect(await got).toMatchObject({ kind: 'mismatch', code: 'NIXL_ERR_MISMATCH' });
    } finally {
      rogue.close();
    }
  });
});

describe('hostile registrations', () => {
  it('garbage, non-maps, missing fields, another engine, huge lists: refused, nothing touched, next push served', async () => {
    const t = await start({ sender: { regLimits: { maxBlocks: 64 } } });
    const rogue = new NixlAgent('rogue', { engine: ENGINE });
    try {
      rogue.addRemoteAgent(t.pAgent.getAgentMetadata());
      const sends = [
        Buffer.concat([PUSH_REG_PREFIX, Buffer.from([0xc1])]),
        Buffer.concat([PUSH_REG_PREFIX, packMsgpack([1, 2, 3])]),
        Buffer.concat([PUSH_REG_PREFIX, packMsgpack(new Map([['request_id', 5]]))]),
        Buffer.concat([PUSH_REG_PREFIX, packMsgpack(new Map([['request_id', 'x']]))]),
        encodePushReg(reg(t, { requestId: 'q', remoteEngineId: 'Q' })),
        encodePushReg(reg(t, { requestId: 'big', localBlockIds: [Array.from({ length: 65 }, (_, i) => i)] })),
        encodePushReg(reg(t, { requestId: 'tp4', remoteTpSize: 4 })),
      ];
      for (const m of sends) rogue.sendNotif('push-p', m);
      await until(() => t.sender.stats.refused === sends.length);
      expect(t.sender.pending.registrations).toBe(0);
      const got = t.receiver.receive(t.params(), { requestId: 'ok', localBlockIds: [3] });
      const sent = await t.sender.offer('ok', [9]);
      expect(sent.reason).toBe('written');
      await got;
      expect(t.same([9], [3])).toBe(true);
    } finally {
      rogue.close();
    }
  });

  it("a registration naming a decode, sent by an agent that is not one of that decode's ranks: no WRITE", async () => {
    const t = await start();
    const rogue = new NixlAgent('rogue2', { engine: ENGINE });
    try {
      rogue.addRemoteAgent(t.pAgent.getAgentMetadata());
      rogue.sendNotif('push-p', encodePushReg(reg(t, { requestId: 'forged' })));
      await until(() => t.sender.pending.registrations === 1);
      const sent = await t.sender.offer('forged', [5, 6]);
      expect(sent).toMatchObject({ reason: 'failed', writes: 0 });
      expect(sent.error).toMatchObject({ code: 'NIXL_ERR_NOT_ALLOWED' });
      expect(sent.error?.message).toMatch(/not a rank of decode 'D'/);
      expect(t.untouched()).toBe(true);
    } finally {
      rogue.close();
    }
  });

  it('block ids outside the decode cache are refused before any WRITE; memory untouched on both sides', async () => {
    const t = await start();
    const pBefore = Buffer.from(t.pmem);
    t.dAgent.addRemoteAgent(t.pAgent.getAgentMetadata());
    t.dAgent.sendNotif('push-p', encodePushReg(reg(t, { requestId: 'oob', localBlockIds: [[1, 1000]] })));
    await until(() => t.sender.pending.registrations === 1);
    const sent = await t.sender.offer('oob', [5, 6]);
    expect(sent).toMatchObject({ reason: 'failed', writes: 0 });
    expect(sent.error).toMatchObject({ code: 'NIXL_ERR_INVALID_PARAM' });
    expect(sent.error?.message).toMatch(/outside 0\.\.31/);
    expect(t.untouched()).toBe(true);
    expect(t.pmem.equals(pBefore)).toBe(true);
  });

  it('a decode asking for more blocks than the request has is refused, nothing written; the decode is told at once', async () => {
    const t = await start();
    // A deadline far away: only the prefill's refusal ends the wait.
    const got = t.receiver
      .receive(t.params(), { requestId: 'more', localBlockIds: [1, 2, 3], timeoutMs: 60_000 })
      .catch((e: unknown) => e);
    const sent = await t.sender.offer('more', [5, 6]);
    expect(sent).toMatchObject({ reason: 'failed' });
    expect(sent.error?.message).toMatch(/registered 3 blocks, this request has 2/);
    expect(await got).toMatchObject({ kind: 'refused', code: 'NIXL_ERR_INVALID_PARAM' });
    expect(((await got) as Error).message).toMatch(/refused to write it: the decode registered 3 blocks/);
    // Registered, so its blocks still wait out the quarantine (the refusal is the prefill's word only).
    expect(((await got) as { quarantinedUntilMs?: number }).quarantinedUntilMs).toBeGreaterThan(performance.now());
    expect(t.untouched()).toBe(true);
  });

  it('an exact offer (a KV that is one whole) refuses a decode registering fewer blocks: nothing written', async () => {
    const t = await start();
    const got = t.receiver
      .receive(t.params(), { requestId: 'fewer', localBlockIds: [1], timeoutMs: 60_000 })
      .catch((e: unknown) => e);
    const sent = await t.sender.offer('fewer', [5, 6], { exactBlocks: true });
    expect(sent).toMatchObject({ reason: 'failed', writes: 0, error: { code: 'NIXL_ERR_MISMATCH' } });
    expect(sent.error?.message).toMatch(/registered 1 blocks, this request's KV is one whole of 2/);
    expect(await got).toMatchObject({ kind: 'refused', code: 'NIXL_ERR_MISMATCH' });
    expect(t.untouched()).toBe(true);
    // Not exact: the same registration is a prefix hit, the last block written.
    const got2 = t.receiver.receive(t.params(), { requestId: 'fewer2', localBlockIds: [3], timeoutMs: 60_000 });
    expect(await t.sender.offer('fewer2', [5, 6])).toMatchObject({ reason: 'written', writes: 1 });
    expect((await got2).notifications).toBe(1);
  });

  it('refusals that are forged, malformed or from an agent not registered with are ignored', async () => {
    const t = await start();
    const got = t.receiver
      .receive(t.params(), { requestId: 'forged', localBlockIds: [1, 2], timeoutMs: 1500 })
      .catch((e: unknown) => e);
    await until(() => t.sender.pending.registrations === 1);
    const stranger = new NixlAgent('stranger', { engine: ENGINE });
    try {
      stranger.addRemoteAgent(t.dAgent.getAgentMetadata());
      t.pAgent.addRemoteAgent(t.dAgent.getAgentMetadata());
      for (const msg of [
        encodeRefusal({ requestId: 'forged', code: 'NIXL_ERR_MISMATCH', reason: 'not from the prefill' }),
        `${PUSH_REFUSED_PREFIX}{not json`,
        `${PUSH_REFUSED_PREFIX}${JSON.stringify({ request_id: 'forged', code: 'rm -rf', reason: 'x' })}`,
        `${PUSH_REFUSED_PREFIX}${JSON.stringify({ request_id: 'forged', code: 'NIXL_ERR_MISMATCH', reason: 'y'.repeat(4096) })}`,
      ])
        stranger.sendNotif('push-d', msg);
      // Malformed ones from the prefill's own agent prove nothing either.
      t.pAgent.sendNotif('push-d', `${PUSH_REFUSED_PREFIX}[]`);
      expect(await got).toMatchObject({ kind: 'timeout' });
      expect(t.receiver.unrecognized).toBe(1);
    } finally {
      stranger.close();
    }
  });

  it('duplicate registrations (several decode ranks, one prefill rank) start exactly one push', async () => {
    const t = await start();
    const got = t.receiver.receive(t.params(), { requestId: 'dup', localBlockIds: [1] });
    await until(() => t.sender.pending.registrations === 1);
    t.dAgent.sendNotif('push-p', encodePushReg(reg(t, { requestId: 'dup', localBlockIds: [[1]] })));
    await until(() => t.sender.stats.duplicates === 1);
    const sent = await t.sender.offer('dup', [4]);
    await got;
    expect(sent).toMatchObject({ reason: 'written', writes: 1 });
    t.dAgent.sendNotif('push-p', encodePushReg(reg(t, { requestId: 'dup', localBlockIds: [[1]] })));
    await until(() => t.sender.stats.duplicates === 2);
    expect(t.sender.stats.written).toBe(1);
  });

  it('with a KV secret: unsigned registrations are refused; signed ones are served', async () => {
    const t = await start({ sender: { secret: 'kv-secret' } });
    const unsigned = await t.receiver
      .receive(t.params(), { requestId: 'unsigned', localBlockIds: [1], timeoutMs: 200 })
      .catch((e: unknown) => e);
    expect(unsigned).toMatchObject({ kind: 'timeout' });
    expect(t.sender.stats.refused).toBe(1);
    const signedPair = await start({ sender: { secret: 'kv-secret' }, receiver: { secret: 'kv-secret' }, tag: 's' });
    const got = signedPair.receiver.receive(signedPair.params(), { requestId: 'signed', localBlockIds: [2] });
    expect((await signedPair.sender.offer('signed', [3])).reason).toBe('written');
    await got;
    expect(signedPair.same([3], [2])).toBe(true);
    const wrong = await start({ sender: { secret: 'kv-secret' }, receiver: { secret: 'other' }, tag: 'w' });
    await wrong.receiver
      .receive(wrong.params(), { requestId: 'wrong', localBlockIds: [2], timeoutMs: 200 })
      .catch(() => undefined);
    expect(wrong.sender.stats.refused).toBe(1);
    expect(wrong.untouched()).toBe(true);
  });
});

describe('pull and push peers', () => {
  const pullHash = computeCompatibilityHash(
    {
      vllmVersion: 'nixl-node-test',
      model: 'm',
      dtype: 'torch.float16',
      numKvHeads: 8,
      headSize: 64,
      numHiddenLayers: 2,
      attnBackendName: 'FLASH_ATTN',
      cacheDtype: 'auto',
      isHmaEnabled: false,
      transferMode: 'pull',
    },
    'v12',
  );

  it('a push decode meeting a pull prefill fails typed, naming both modes; nothing registered', async () => {
    const t = await start();
    const pullServer = await servePrefill({
      ranks: [{ agent: t.pAgent, layout: rankLayout('P', t.pmem) }],
      compatibilityHash: pullHash,
      port: 0,
    });
    try {
      const err = (await t.receiver
        .receive(t.params({ remote_port: pullServer.basePort }), { requestId: 'm', localBlockIds: [1] })
        .catch((e: unknown) => e)) as PushError;
      expect(err).toBeInstanceOf(PushError);
      expect(err.kind).toBe('handshake');
      expect(err.cause).toBeInstanceOf(TransferModeError);
      expect(err.message).toMatch(/moves KV by push and the peer by pull/);
      expect(err.quarantinedUntilMs).toBeUndefined();
      expect(t.sender.pending.registrations).toBe(0);
    } finally {
      await pullServer.close();
    }
  });

  it('a pull decode meeting a push prefill fails typed, naming both modes', async () => {
    const t = await start();
    const puller = new KvPuller({ agent: t.dAgent, layout: rankLayout('D', t.dmem), expectedHash: pullHash });
    try {
      const err = await puller
        .pullBlocks({
          remote: { host: '127.0.0.1', port: t.pServer.basePort, tpSize: 1 },
          localBlockIds: [1],
          remoteBlockIds: [1],
          requestId: 'x',
        })
        .catch((e: unknown) => e);
      expect(err).toBeInstanceOf(PullError);
      expect((err as PullError).cause).toBeInstanceOf(TransferModeError);
      expect((err as Error).message).toMatch(/moves KV by pull and the peer by push/);
    } finally {
      await puller.close();
    }
  });

  it('push params given to a pull decode, and pull params given to a push decode, are refused by name', async () => {
    const t = await start();
    const recv = await t.receiver
      .receive(t.params({ transfer_mode: 'pull' }), { requestId: 'pp', localBlockIds: [1] })
      .catch((e: unknown) => e);
    expect(recv).toMatchObject({ kind: 'setup' });
    expect((recv as PushError).cause).toBeInstanceOf(TransferModeError);
    const r2 = new KvPushReceiver({
      agent: t.dAgent,
      layout: rankLayout('D2', t.dmem),
      decodeHost: '127.0.0.1',
      decodePort: 1,
      wire: 'v12',
    });
    await r2.close();
    expect(
      () =>
        new KvPushReceiver({
          agent: t.dAgent,
          layout: rankLayout('D3', t.dmem),
          decodeHost: '127.0.0.1',
          decodePort: 1,
          wire: 'v0.13',
        }),
    ).toThrow(/push mode is not part of the v0.13/);
  });
});

describe('push params at a pull decode', () => {
  it("KvPuller.pullFromParams refuses a push prefill's params with a TransferModeError", async () => {
    const t = await start();
    const puller = new KvPuller({ agent: t.dAgent, layout: rankLayout('D', t.dmem) });
    try {
      const err = await puller
        .pullFromParams(
          {
            do_remote_prefill: true,
            remote_block_ids: [[1]],
            remote_engine_id: 'P',
            remote_request_id: 'x',
            remote_host: '127.0.0.1',
            remote_port: t.pServer.basePort,
            tp_size: 1,
            pp_size: 1,
            transfer_mode: 'push',
          },
          { localBlockIds: [1] },
        )
        .catch((e: unknown) => e);
      expect(err).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_MISMATCH' });
      expect((err as PullError).cause).toBeInstanceOf(TransferModeError);
      expect((err as Error).message).toMatch(/moves KV by pull and the peer by push/);
    } finally {
      await puller.close();
    }
  });
});
