// End to end on the loopback engine, real processes: a prefill engine (all
// its TP ranks in one process) and one process per decode rank. Every byte
// of every decode rank's slice is checked against the block it came from.
import { fork } from 'node:child_process';
import { once } from 'node:events';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
import { FIXTURES, Peer } from '../helpers';

interface Spec {
  heads: number;
  headBytes: number;
  numBlocks: number;
  regions: number;
  mla?: boolean;
  method: 'zmq' | 'http';
}

interface DecodeReport {
  results: Array<{
    ok: boolean;
    bad?: number;
    bytes?: number;
    descriptors?: number;
    ranks?: number[];
    coalesced?: boolean;
    kind?: string;
    code?: string;
    localBlockIds?: number[];
  }>;
  resources: { xferHandles: number; localDlists: number; engines: number; activePulls: number };
  prometheus: string;
}

async function startPrefill(spec: Spec & { tpSize: number; expireMs?: number }) {
  const peer = new Peer('prefill-kv.js', [JSON.stringify(spec)]);
  const { port } = await peer.next<{ port: number }>();
  return { peer, port };
}

async function runDecode(
  spec: Spec & {
    handshakeTimeoutMs?: number;
    tpSize: number;
    tpRank: number;
    port: number;
    prefillTp: number;
    coalesce?: boolean;
    pulls: Array<{ requestId: string; local: number[]; remote: number[] }>;
  },
): Promise<DecodeReport> {
  const p = fork(path.join(FIXTURES, 'decode-kv.js'), [JSON.stringify(spec)], {
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
  });
  const [msg] = await once(p, 'message');
  await once(p, 'exit');
  return msg as DecodeReport;
}

const cases: Array<[string, number, number, boolean]> = [
  ['prefill TP=2 -> decode TP=4', 2, 4, false],
  ['prefill TP=4 -> decode TP=2', 4, 2, false],
  ['prefill TP=2 -> decode TP=2', 2, 2, false],
  ['MLA, prefill TP=2 -> decode TP=4', 2, 4, true],
  ['MLA, prefill TP=4 -> decode TP=2', 4, 2, true],
];

describe.each(cases)('%s', (_name, pTp, dTp, mla) => {
  it.each(['zmq', 'http'] as const)(
    'handshake over %s, pull, every byte verified, prefill frees the blocks',
    async (method) => {
      const spec: Spec = { heads: 8, headBytes: 256, numBlocks: 24, regions: 4, mla, method };
      const { peer, port } = await startPrefill({ ...spec, tpSize: pTp });
      try {
        const pulls = [
          { requestId: 'req-a', local: [3, 4, 5, 6, 7], remote: [10, 11, 12, 13, 14] }, // adjacent: coalesces
          { requestId: 'req-b', local: [0, 9, 2], remote: [20, 1, 17] },
          { requestId: 'req-c', local: [15, 16], remote: [5, 6, 7, 8] }, // partial prefix hit: last two
        ];
        // the prefill side waits for all reads of each request
        const released = pulls.map((p) => {
          peer.send({ cmd: 'expect', requestId: p.requestId, blockIds: p.remote });
          return p.requestId;
        });
        const reports = await Promise.all(
          Array.from({ length: dTp }, (_, r) =>
            runDecode({ ...spec, tpSize: dTp, tpRank: r, port, prefillTp: pTp, pulls, coalesce: true }),
          ),
        );
        reports.forEach((rep, r) => {
          for (const res of rep.results) {
            expect(res.ok, JSON.stringify(res)).toBe(true);
            expect(res.bad).toBe(0);
          }
          const ratio = dTp >= pTp ? dTp / pTp : -(pTp / dTp);
          expect(rep.results[0].ranks).toEqual(
            ratio > 0 ? [Math.floor(r / ratio)] : Array.from({ length: -ratio }, (_, i) => r * -ratio + i),
          );
          expect(rep.resources.xferHandles).toBe(0);
          expect(rep.resources.activePulls).toBe(0);
          expect(rep.prometheus).toContain(`nixl_node_transfers_total{rank="${r}"} 3`);
        });
        if (!mla && dTp === pTp) expect(reports[0].results[0].coalesced).toBe(true); // both sides contiguous
        for (let i = 0; i < released.length; i++) {
          const m = await peer.next<{ released: string[] }>();
          expect(m.released).toEqual(Array(pTp).fill('read'));
        }
      } finally {
        peer.send({ cmd: 'exit' });
        await peer.exit();
      }
    },
    60_000,
  );
});

describe('failures name the blocks to recompute', () => {
  const spec = { heads: 4, headBytes: 128, numBlocks: 8, regions: 2, method: 'zmq' as const, handshakeTimeoutMs: 300 };

  it('a handshake with nobody fails as kind handshake', async () => {
    const rep = await runDecode({
      ...spec,
      tpSize: 1,
      tpRank: 0,
      port: 1,
      prefillTp: 1,
      pulls: [{ requestId: 'x', local: [1, 2], remote: [3, 4] }],
    });
    expect(rep.results[0]).toMatchObject({ ok: false, kind: 'handshake', localBlockIds: [1, 2] });
    expect(rep.resources.xferHandles).toBe(0);
  }, 60_000);

  it('a prefill process that died after the handshake fails as kind peer-gone', async () => {
    const { peer, port } = await startPrefill({ ...spec, tpSize: 1 });
    // First decode handshakes and pulls fine; we kill the prefill, then pull again in a new decode.
    const ok = await runDecode({
      ...spec,
      tpSize: 1,
      tpRank: 0,
      port,
      prefillTp: 1,
      pulls: [{ requestId: 'x', local: [1], remote: [2] }],
    });
    expect(ok.results[0].ok).toBe(true);
    peer.kill();
    await peer.exit();
    const rep = await runDecode({
      ...spec,
      tpSize: 1,
      tpRank: 0,
      port,
      prefillTp: 1,
      pulls: [{ requestId: 'y', local: [5, 6], remote: [1, 2] }],
    });
    expect(rep.results[0]).toMatchObject({ ok: false, localBlockIds: [5, 6] });
    expect(['handshake', 'peer-gone']).toContain(rep.results[0].kind);
  }, 60_000);

  it('bad block ids and layout mismatches fail as kind setup', async () => {
    const { peer, port } = await startPrefill({ ...spec, tpSize: 1 });
    try {
      const rep = await runDecode({
        ...spec,
        tpSize: 1,
        tpRank: 0,
        port,
        prefillTp: 1,
        pulls: [
          { requestId: 'x', local: [99], remote: [1] },
          { requestId: 'y', local: [1], remote: [1000] },
        ],
      });
      expect(rep.results[0]).toMatchObject({
        ok: false,
        kind: 'setup',
        code: 'NIXL_ERR_INVALID_PARAM',
        localBlockIds: [99],
      });
      expect(rep.results[1]).toMatchObject({ ok: false, kind: 'setup', code: 'NIXL_ERR_INVALID_PARAM' });
      const mismatch = await runDecode({
        ...spec,
        headBytes: 64,
        tpSize: 1,
        tpRank: 0,
        port,
        prefillTp: 1,
        pulls: [{ requestId: 'z', local: [1], remote: [1] }],
      });
      expect(mismatch.results[0]).toMatchObject({ ok: false, kind: 'handshake', code: 'NIXL_ERR_MISMATCH' });
    } finally {
      peer.send({ cmd: 'exit' });
      await peer.exit();
    }
  }, 60_000);
});
