// Push mode over real NIXL against a vLLM-format peer of our own on NIXL's
// Python API (test/fixtures/vllm_nixl_push_peer.py), in each role: a Python
// decode registering its blocks with a nixl-node prefill, and a Python
// prefill WRITEing into a nixl-node decode. Skipped, saying why, without an
// addon built against NIXL or without Python's nixl_cu12, msgpack and zmq
// (CI has no NIXL; `. ENV.sh` of a NIXL install provides them here).
import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { pyPeer as peer, nixlRank as rank, open, pyPrefillToRank, pythonNixlMissing, rankSender } from './nixl-py-peer';
import { PUSH_HASH, REGIONS, BLOCK, blockOf } from './push-helpers';

const why = pythonNixlMissing();
if (why) console.warn(`push interop over NIXL skipped: ${why}`);

const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

describe.skipIf(why !== undefined)('push interop over NIXL with a vLLM-format Python peer', () => {
  it('a Python decode registers with a nixl-node prefill, which WRITEs with the notification <id>:<tp>', async () => {
    const p = await rank('push-p', 'P', 3);
    const sender = rankSender(p, 20_000);
    const id = 'cmpl-py-0a1b2c3d';
    const py = peer(['decode', String(p.server.basePort), PUSH_HASH, 'P', id, '5,6,7']);
    open.push(() => py.p.kill());
    // The prefill finished first (its blocks 1, 2, 3); the registration pairs with it by id.
    const sent = await sender.offer(id, [1, 2, 3]);
    expect(sent, py.output()).toMatchObject({ reason: 'written', decodeRequestId: id, writes: 1 });
    expect(sent.bytes).toBe(3 * REGIONS * BLOCK);
    const got = await py.line(/^GOT (\S+) (\S+)$/);
    expect(got.slice(1)).toEqual(['push-p', `${id}:1`]);
    expect(await py.exited).toBe(0);
    // What the Python decode held when it saw the notification: the prefill's bytes, every block and region.
    const d = py.digests();
    for (const [i, b] of [5, 6, 7].entries())
      for (let r = 0; r < REGIONS; r++)
        expect(d.get(`${r}/${b}`), `region ${r} block ${b}`).toBe(sha(blockOf(p.mem, r, 1 + i)));
    expect(sender.resources()).toMatchObject({ offers: 0, registrations: 0, xferHandles: 0 });
  });

  it("a Python prefill takes a nixl-node decode's PUSH_REG, handshakes back over v12 and WRITEs into its blocks", async () => {
    const { py, d, receiver, params } = await pyPrefillToRank('push-d', 20_000);
    const r = await receiver.receive(params, { requestId: 'cmpl-q-0a1b2c3d', localBlockIds: [9, 10, 11] });
    expect(r).toMatchObject({ requestId: 'cmpl-q-0a1b2c3d', notifications: 1, writers: ['py-prefill-0'] });
    expect((await py.line(/^REG (\S+) (\S+)$/)).slice(1)).toEqual(['push-d', 'cmpl-q-0a1b2c3d']);
    expect((await py.line(/^WROTE (\S+) (\S+)$/)).slice(1)).toEqual(['push-d', 'DONE']);
    const digests = py.digests();
    for (const [i, b] of [9, 10, 11].entries())
      for (let q = 0; q < REGIONS; q++)
        expect(sha(blockOf(d.mem, q, b)), `region ${q} block ${b}`).toBe(digests.get(`${q}/${1 + i}`));
    // Nothing else written: block 8 and 12 still zero.
    expect(blockOf(d.mem, 0, 8).every((x) => x === 0) && blockOf(d.mem, 1, 12).every((x) => x === 0)).toBe(true);
    expect(await py.exited).toBe(0);
    expect(receiver.resources()).toMatchObject({ receiving: 0, quarantined: 0 });
  });
});
