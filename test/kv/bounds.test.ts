// What a peer or a request sizes cannot take the decode process down: every
// count is bounded before anything is allocated or opened, a violation fails
// that one pull with a typed error naming the field, and the next valid pull
// works. Each numeric field of the metadata and of kv_transfer_params is
// mutated towards 0, -1, 2^31, 2^53 and 2^64-1.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  KvPuller,
  NixlAgent,
  PullError,
  allocate,
  buildKvTransferParams,
  servePrefill,
  type KvLayout,
} from '../../lib';
import { type HandshakeServer, type HandshakeStrategy, createHandshake, wireV12 } from '../../lib/handshake';
import { type MpValue, packMsgpack } from '../../lib/handshake/msgpack';
import { encodeFields } from '../../lib/handshake/fields';
import { toAgentMetadata } from '../../lib/kv/layout';
import { tp1Layout } from '../helpers';
import { expandTail } from '../../lib/kv/limits';

const BLOCK = 4096;
const BLOCKS = 32;
const quiet = { warn() {} };

const layout = (engineId: string, mem: Buffer) =>
  tp1Layout(engineId, mem, { blockLen: BLOCK, blocks: BLOCKS, regions: 2 });

let prefill: NixlAgent;
let decode: NixlAgent;
let pmem: Buffer;
let dmem: Buffer;
let good: HandshakeServer;
let puller: KvPuller;
let pLayout: KvLayout;
const servers: HandshakeServer[] = [];
// Counts what the puller asks of the side channel: a refused request opens nothing.
let fetches = 0;
let inFlight = 0;
let maxInFlight = 0;

beforeAll(async () => {
  prefill = new NixlAgent('bounds-p', { engine: 'loopback' });
  decode = new NixlAgent('bounds-d', { engine: 'loopback' });
  pmem = allocate(2 * BLOCK * BLOCKS);
  for (let i = 0; i < pmem.length; i++) pmem[i] = (i * 7 + (i >> 12)) & 0xff;
  dmem = allocate(2 * BLOCK * BLOCKS);
  prefill.registerMemory(pmem);
  decode.registerMemory(dmem);
  pLayout = layout('P', pmem);
  good = await servePrefill({
    ranks: [{ agent: prefill, layout: pLayout }],
    compatibilityHash: 'h',
    port: 0,
    logger: quiet,
  });
  const inner = createHandshake('zmq');
  const counting: HandshakeStrategy = {
    ...inner,
    fetch: async (o) => {
      fetches++;
      maxInFlight = Math.max(maxInFlight, ++inFlight);
      try {
        return await inner.fetch(o);
      } finally {
        inFlight--;
      }
    },
    serve: (o) => inner.serve(o),
    close: () => inner.close(),
  };
  puller = new KvPuller({
    agent: decode,
    layout: layout('D', dmem),
    handshake: counting,
    expectedHash: 'h',
    handshakeTimeoutMs: 300,
    wire: 'v12',
  });
});

afterAll(async () => {
  await puller.close();
  for (const s of servers) await s.close();
  await good.close();
  prefill.close();
  decode.close();
});

const params = (port: number, extra: Record<string, unknown> = {}) => ({
  ...buildKvTransferParams(
    {
      remoteBlockIds: [[3, 4, 5]],
      remoteEngineId: 'P',
      remoteRequestId: 'r',
      remoteHost: '127.0.0.1',
      remotePort: port,
      tpSize: 1,
    },
    'v12',
  ),
  ...extra,
});

let nextId = 0;
/** A valid pull from the real prefill: the puller still serves, with the right bytes. */
async function validPull(): Promise<void> {
  dmem.fill(0);
  const r = await puller.pullFromParams(
    { ...params(good.basePort), remote_request_id: `ok-${nextId++}` },
    {
      localBlockIds: [0, 1, 2],
    },
  );
  expect(r.bytes).toBe(2 * 3 * BLOCK);
  for (const region of [0, 1]) {
    const at = region * BLOCK * BLOCKS;
    expect(dmem.subarray(at, at + 3 * BLOCK).equals(pmem.subarray(at + 3 * BLOCK, at + 6 * BLOCK))).toBe(true);
  }
}

const EXTREMES: MpValue[] = [0, -1, 2 ** 31, 2n ** 53n, 2n ** 64n - 1n];

describe('bounds on what a peer sends', () => {
  it('physical_blocks_per_logical_kv_block = 2^30 fails the pull as setup, naming the field; the next pull works', async () => {
    const s = await tamperedServer((m) => m.set('physical_blocks_per_logical_kv_block', 2 ** 30));
    const err = await puller
      .pullFromParams(params(s.basePort), { localBlockIds: [0, 1, 2] })
      .catch((e: PullError) => e);
    expect(err).toBeInstanceOf(PullError);
    expect(err).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_INVALID_PARAM' });
    expect((err as Error).message).toMatch(/physical_blocks_per_logical_kv_block: 1073741824 is out of bounds/);
    await validPull();
  });

  it('every numeric metadata field at 0, -1, 2^31, 2^53, 2^64-1: a typed error or right bytes, never a crash', async () => {
    const numeric = [
      'kv_caches_base_addr',
      'device_id',
      'num_blocks',
      'block_lens',
      'block_strides',
      'block_size',
      'ssm_sizes',
      'physical_blocks_per_logical_kv_block',
      'region_num_blocks',
      'dcp_size',
      'pcp_size',
    ];
    let refused = 0;
    let served = 0;
    for (const key of numeric)
      for (const v of EXTREMES) {
        const s = await tamperedServer((m) => {
          const cur = m.get(key);
          m.set(key, Array.isArray(cur) ? cur.map((x, i) => (i === cur.length - 1 ? v : x)) : v);
        });
        const outcome = await puller
          .pullFromParams(params(s.basePort, { remote_request_id: `m-${key}-${v}` }), { localBlockIds: [0, 1, 2] })
          .then(
            () => 'ok',
            (e: unknown) => e,
          );
        if (outcome === 'ok') served++;
        else {
          expect(outcome, `${key}=${v}`).toBeInstanceOf(PullError);
          expect(String((outcome as PullError).code), `${key}=${v}`).toMatch(/^NIXL_ERR_/);
          refused++;
        }
        await validPull();
      }
    expect(refused).toBeGreaterThan(40);
    expect(refused + served).toBe(numeric.length * EXTREMES.length);
  });
});

describe('bounds on what a request sends', () => {
  it('tp_size 4096 and pp_size 2^24 are refused before any handshake, naming the field and the bound', async () => {
    const before = fetches;
    for (const [extra, field] of [
      [{ tp_size: 4096 }, 'tp_size'],
      [{ pp_size: 2 ** 24 }, 'pp_size'],
      [{ tp_size: 2048 }, 'tp_size'],
    ] as const) {
      const err = await puller.pullFromParams(params(1, extra), { localBlockIds: [0] }).catch((e: PullError) => e);
      expect(err).toMatchObject({ kind: 'setup', code: 'NIXL_ERR_INVALID_PARAM' });
      expect((err as Error).message).toMatch(new RegExp(`${field}: .* out of bounds`));
    }
    expect(fetches - before).toBe(0);
    await validPull();
  });

  it('a wide fan-out within the limits opens at most handshakeConcurrency side-channel requests at once', async () => {
    maxInFlight = 0;
    const before = fetches;
    // 64 remote TP ranks for our TP 1: nobody listens on port 9 (discard), each handshake times out.
    const err = await puller.pullFromParams(params(9, { tp_size: 64 }), { localBlockIds: [0] }).catch((e) => e);
    expect(err).toBeInstanceOf(PullError);
    expect(maxInFlight).toBeLessThanOrEqual(8);
    // The first failure stops the queue: far fewer than 64 were asked.
    expect(fetches - before).toBeLessThan(64);
    await validPull();
  });

  it('every numeric kv_transfer_params field at 0, -1, 2^31, 2^53, 2^64-1: a typed error or right bytes', async () => {
    const fields: Array<[string, (v: number) => unknown]> = [
      ['remote_block_ids', (v) => [[3, 4, v]]],
      ['remote_port', (v) => v],
      ['tp_size', (v) => v],
      ['dcp_size', (v) => v],
      ['pp_size', (v) => v],
      ['remote_num_tokens', (v) => v],
      ['remote_blocks_expiry_time', (v) => v],
    ];
    for (const [key, make] of fields)
      for (const v of [0, -1, 2 ** 31, 2 ** 53, Number('18446744073709551615')]) {
        // As a JSON body brings them: 2^64-1 arrives as a float.
        const body = JSON.parse(
          JSON.stringify(params(good.basePort, { [key]: make(v), remote_request_id: `k-${key}-${v}` })),
        );
        const outcome = await puller.pullFromParams(body, { localBlockIds: [0, 1, 2] }).then(
          () => 'ok',
          (e: unknown) => e,
        );
        if (outcome !== 'ok') {
          expect(outcome, `${key}=${v}`).toBeInstanceOf(PullError);
          expect(String((outcome as PullError).code), `${key}=${v}`).toMatch(/^NIXL_ERR_/);
        }
        await validPull();
      }
  }, 60_000);

  it('expands only the kernel blocks a pull needs, checking every logical id', () => {
    expect(expandTail([2, 5], 4, 6, 64)).toEqual([10, 11, 20, 21, 22, 23]);
    expect(expandTail([7], 1, 1, 8)).toEqual([7]);
    expect(() => expandTail([2, 16], 4, 2, 64)).toThrow(/logical block 16/);
    expect(() => expandTail([1], 2 ** 30, 3, 2 ** 31)).not.toThrow();
    expect(expandTail([1], 2 ** 30, 3, 2 ** 31)).toHaveLength(3);
    expect(() => expandTail([0], 2, 3, 64)).toThrow(/3 local blocks but only 2 remote/);
  });
});

/** A side channel serving the real prefill's metadata with one edit. */
async function tamperedServer(edit: (m: Map<string, MpValue>) => void): Promise<HandshakeServer> {
  const md = toAgentMetadata(pLayout, prefill.getAgentMetadata());
  const m = encodeFields(wireV12.metadataFields, md as unknown as Record<string, unknown>, 'md');
  edit(m);
  const s = await createHandshake('zmq').serve({
    port: 0,
    payloads: [{ ppRank: 0, tpRank: 0, payload: { compatibilityHash: 'h', agentMetadataBytes: packMsgpack(m) } }],
    wire: wireV12,
    logger: quiet,
  });
  servers.push(s);
  return s;
}
