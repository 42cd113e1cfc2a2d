// A layered request's notification on the loopback engine, which posts in
// order: it goes out after every layer's bytes and before the notification of
// a transfer posted after the last layer, once per posting whichever layer is
// posted last, and the posting is DONE only once the peer has taken it.
import { afterEach, expect, it } from 'vitest';
import { DescList, NixlAgent, allocate } from '../../lib';
import { Peer } from '../helpers';

// Above inlinePostMaxBytes, and never inline by time (inlinePostMaxUs: 0): every layer goes through the engine's thread.
const LAYER = 2 << 20;
const SIZE = 4 * LAYER;
let peer: Peer | undefined;
let agent: NixlAgent | undefined;

afterEach(() => {
  agent?.close();
  agent = undefined;
  if (peer) {
    try {
      process.kill(peer.proc.pid!, 'SIGCONT');
    } catch {
      /* gone */
    }
    if (peer.proc.exitCode === null) peer.kill();
  }
  peer = undefined;
});

async function setup() {
  agent = new NixlAgent('lnp', { engine: 'loopback', inlinePostMaxUs: 0 });
  const mem = allocate(SIZE);
  mem.fill(9);
  agent.registerMemory(mem);
  peer = new Peer('peer.js');
  const init = await peer.initAgent({ name: 'lnp-peer', size: SIZE, shared: true, seed: 2 });
  agent.addRemoteAgent(Buffer.from(init.md));
  const blocks = (base: bigint) =>
    DescList.from(Array.from({ length: 4 }, (_, i) => ({ addr: base + BigInt(i * LAYER), len: LAYER })));
  const local = agent.prepXferDlist('NIXL_INIT_AGENT', blocks(DescList.from(mem).addr(0)));
  const remote = agent.prepXferDlist('lnp-peer', blocks(init.addr));
  // Two layers of one 2 MiB block each (blocks 0 and 1); block 3 for an ordinary transfer after them.
  const h = agent.makeLayeredXfer('WRITE', local, [[0], [1]], remote, [[0], [1]], 'L');
  const after = agent.makePreppedXfer('WRITE', local, [3], remote, [3], 'after');
  return { a: agent, p: peer, h, after };
}

async function notifsOf(p: Peer, until: (got: string[]) => boolean): Promise<string[]> {
  const got: string[] = [];
  for (let t = 0; t < 250 && !until(got); t++) {
    got.push(...(await p.request<{ msgs: string[] }>({ cmd: 'notifs', from: 'lnp' })).msgs.map((m) => m.split(':')[0]));
    if (!until(got)) await new Promise((r) => setTimeout(r, 20));
  }
  return got;
}

it('the notification comes after every layer and before a transfer posted after the last layer, once per posting', async () => {
  const { a, p, h, after } = await setup();
  for (let round = 0; round < 6; round++) {
    // The last layer posted alternates, so the layer that carried the notification last time is posted first.
    const order = round % 2 ? [1, 0] : [0, 1];
    for (const l of order) a.postLayer(h, l);
    a.transfer(after);
    await Promise.all([a.wait(h, { timeoutMs: 10_000 }), a.wait(after, { timeoutMs: 10_000 })]);
    const got = await notifsOf(p, (g) => g.length >= 2);
    expect(got, `round ${round}`).toEqual(['L', 'after']);
  }
  const data = (await p.request<{ data: Uint8Array }>({ cmd: 'dump' })).data;
  expect(data[0]).toBe(9);
  expect(data[2 * LAYER - 1]).toBe(9);
});

it('a posting is DONE only once the peer took its notification (a stopped peer keeps it PROC)', async () => {
  const { a, p, h, after } = await setup();
  process.kill(p.proc.pid!, 'SIGSTOP');
  // Fill the stopped peer's socket queue so that the layered notification queues behind it. How much fills it
  // depends on the machine (net.unix.max_dgram_qlen, the socket buffers' caps): send until a probe transfer's
  // own notification stays queued.
  const big = Buffer.alloc(60_000, 1);
  const sent: string[] = [];
  for (let batch = 0; batch < 20; batch++) {
    for (let i = 0; i < 16; i++) {
      sent.push(`n${sent.length}`);
      a.sendNotif('lnp-peer', Buffer.concat([Buffer.from(`${sent[sent.length - 1]}:`), big]));
    }
    sent.push('after');
    a.transfer(after);
    await new Promise((r) => setTimeout(r, 50));
    if (a.checkXferState(after) === 'PROC') break;
  }
  expect(a.checkXferState(after), 'the stopped peer never refused a notification').toBe('PROC');
  a.postLayer(h, 0);
  a.postLayer(h, 1);
  const done = a.wait(h, { timeoutMs: 20_000 });
  await new Promise((r) => setTimeout(r, 300));
  expect(a.checkXferState(h)).toBe('PROC');
  process.kill(p.proc.pid!, 'SIGCONT');
  await done;
  const got = await notifsOf(p, (g) => g.includes('L'));
  expect(got).toEqual([...sent, 'L']);
});
