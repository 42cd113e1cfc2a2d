// One KvPeers per agent: a push worker's puller, push receiver and push
// sender share its connections, so each remote engine is handshaked and its
// agent loaded once, whichever role reached it first; the roles never close
// what they were given, and peers over another agent are refused. Without
// one, a worker whose receiver reached a peer fails to WRITE to that same
// peer (its sender's cache loads the peer's agent again: "already loaded").
import { afterEach, describe, expect, it, vi } from 'vitest';
import {
  KvPuller,
  KvPushReceiver,
  KvPushSender,
  NixlAgent,
  allocate,
  createHandshake,
  servePrefill,
  type KvLayout,
} from '../../lib';
import type { HandshakeServer, HandshakeStrategy } from '../../lib/handshake';
import { KvPeers } from '../../lib/kv/peers';
import { BLOCK, BLOCKS, ENGINE, PUSH_HASH, REGIONS, blockOf, fill, quiet, rankLayout, until } from './push-helpers';

/** A push worker: its agent, memory, side channel and a handshake client that counts its fetches. */
interface Side {
  name: string;
  agent: NixlAgent;
  mem: Buffer;
  layout: KvLayout;
  server: HandshakeServer;
  fetches: number;
  handshake: HandshakeStrategy;
}

const closers: Array<() => unknown> = [];
afterEach(async () => {
  for (const f of closers.splice(0).reverse())
    await Promise.resolve()
      .then(f)
      .catch(() => undefined);
});

async function side(name: string, seed: number): Promise<Side> {
  const agent = new NixlAgent(`peers-${name}`, { engine: ENGINE });
  const mem = allocate(REGIONS * BLOCKS * BLOCK);
  fill(mem, seed);
  agent.registerMemory(mem);
  const layout = rankLayout(name, mem);
  const server = await servePrefill({ ranks: [{ agent, layout }], compatibilityHash: PUSH_HASH, port: 0 });
  closers.push(
    () => agent.close(),
    () => server.close(),
  );
  const hs = createHandshake();
  const s: Side = { name, agent, mem, layout, server, fetches: 0, handshake: hs };
  s.handshake = {
    method: hs.method,
    serve: (o) => hs.serve(o),
    fetch: (o) => {
      s.fetches++;
      return hs.fetch(o);
    },
    close: () => hs.close(),
  };
  return s;
}

/** The three KV roles of a push worker over `s`, given `peers` (or each its own). */
function roles(s: Side, peers?: KvPeers) {
  const common = { agent: s.agent, layout: s.layout, expectedHash: PUSH_HASH, handshake: s.handshake, peers };
  const puller = new KvPuller(common);
  const receiver = new KvPushReceiver({
    ...common,
    decodeHost: '127.0.0.1',
    decodePort: s.server.basePort,
    kvLeaseMs: 5000,
    timeoutMs: 5000,
  });
  const sender = new KvPushSender({ ...common, leaseMs: 5000, logger: quiet });
  closers.push(
    () => puller.close(),
    () => receiver.close(),
    () => sender.close(),
  );
  return { puller, receiver, sender };
}

const params = (to: Side, id: string) => ({
  do_remote_prefill: true,
  remote_engine_id: to.name,
  remote_request_id: id,
  remote_host: '127.0.0.1',
  remote_port: to.server.basePort,
  tp_size: 1,
  pp_size: 1,
});

const same = (from: Side, to: Side, f: number[], t: number[]) =>
  f.every((b, i) =>
    Array.from({ length: REGIONS }, (_, r) => blockOf(from.mem, r, b).equals(blockOf(to.mem, r, t[i]))).every(Boolean),
  );

/** w pushes its blocks 1,2 to v's 5,6 (w's sender), then v pushes its 3,4 to w's 9,10 (w's receiver). */
async function bothWays(w: Side, wRoles: ReturnType<typeof roles>, v: Side, vRoles: ReturnType<typeof roles>) {
  const got = vRoles.receiver.receive(params(w, 'to-v'), { requestId: 'to-v', localBlockIds: [5, 6] });
  await until(() => wRoles.sender.pending.registrations === 1, 5000);
  expect(await wRoles.sender.offer('to-v', [1, 2])).toMatchObject({ reason: 'written' });
  await got;
  expect(same(w, v, [1, 2], [5, 6])).toBe(true);
  const sent = vRoles.sender.offer('to-w', [3, 4]);
  await wRoles.receiver.receive(params(v, 'to-w'), { requestId: 'to-w', localBlockIds: [9, 10] });
  expect((await sent).reason).toBe('written');
  expect(same(v, w, [3, 4], [9, 10])).toBe(true);
}

describe('one KvPeers per agent', () => {
  it('the puller, the push receiver and the push sender given one KvPeers connect to a remote engine once', async () => {
    const w = await side('W', 1);
    const v = await side('V', 2);
    const peers = new KvPeers({ agent: w.agent, layout: w.layout, handshake: w.handshake });
    closers.push(() => peers.close());
    const loads = vi.spyOn(w.agent, 'addRemoteAgent');
    const vPeers = new KvPeers({ agent: v.agent, layout: v.layout });
    closers.push(() => vPeers.close());
    const wRoles = roles(w, peers);
    await bothWays(w, wRoles, v, roles(v, vPeers));
    await wRoles.puller.connect({ host: '127.0.0.1', port: v.server.basePort, tpSize: 1, engineId: 'V' });
    // The sender's connection (a full one) served the receiver and the puller too.
    expect(w.fetches).toBe(1);
    expect(loads).toHaveBeenCalledTimes(1);
    expect(peers.resources()).toMatchObject({ engines: 1, remoteAgents: 1 });
    // A receive that times out (a slow prefill, or a gone one) leaves the connection the other roles use.
    const late = await wRoles.receiver
      .receive(params(v, 'never'), { requestId: 'never', localBlockIds: [20], timeoutMs: 200 })
      .catch((e: unknown) => e);
    expect(late).toMatchObject({ kind: 'timeout' });
    expect(peers.resources()).toMatchObject({ engines: 1, remoteAgents: 1 });
    expect(w.fetches).toBe(1);
    // The roles close; what they were given stays with its maker.
    await Promise.all([wRoles.puller.close(), wRoles.receiver.close(), wRoles.sender.close()]);
    expect(peers.resources()).toMatchObject({ engines: 1, remoteAgents: 1 });
    await peers.close();
    expect(peers.resources()).toMatchObject({ engines: 0, remoteAgents: 0, localDlists: 0 });
  });

  it('a notif-only connection made first loads the remote agent once with the full one made after it', async () => {
    const w = await side('W', 1);
    const v = await side('V', 2);
    const peers = new KvPeers({ agent: w.agent, layout: w.layout, handshake: w.handshake });
    closers.push(() => peers.close());
    const loads = vi.spyOn(w.agent, 'addRemoteAgent');
    const wRoles = roles(w, peers);
    const sent = roles(v).sender.offer('first', [3]);
    await wRoles.receiver.receive(params(v, 'first'), { requestId: 'first', localBlockIds: [9] });
    expect((await sent).reason).toBe('written');
    await wRoles.puller.connect({ host: '127.0.0.1', port: v.server.basePort, tpSize: 1, engineId: 'V' });
    // Two connections (a notif-only one checks no geometry), one agent loaded.
    expect(w.fetches).toBe(2);
    expect(loads).toHaveBeenCalledTimes(1);
    expect(peers.resources()).toMatchObject({ engines: 2, remoteAgents: 1 });
    await peers.close();
    expect(peers.resources()).toMatchObject({ engines: 0, remoteAgents: 0 });
  });

  it('peers over another agent, KV cache or wire profile are refused', async () => {
    const w = await side('W', 1);
    const v = await side('V', 2);
    const peers = new KvPeers({ agent: w.agent, layout: w.layout });
    closers.push(() => peers.close());
    expect(() => new KvPuller({ agent: v.agent, layout: v.layout, peers })).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
    expect(() => new KvPushSender({ agent: w.agent, layout: { ...w.layout, engineId: 'other' }, peers })).toThrow(
      /KV cache/,
    );
    expect(() => new KvPuller({ agent: w.agent, layout: w.layout, wire: 'v11', peers })).toThrow(/wire profile/);
  });
});
