// Interop with vLLM's side of the ZMQ handshake in both wire profiles, run by
// a Python peer of our own (msgpack + pyzmq: Debian python3-msgpack,
// python3-zmq; .ci/run installs them), in both directions.
import { type ChildProcess, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
import { DescList, NixlAgent, allocate } from '../../lib';
import { decodeAgentMetadata, encodeAgentMetadata, zmqHandshake } from '../../lib/handshake';
import { KvPuller, PullError } from '../../lib/kv';
import { FIXTURES, PY, onFreePort, pythonZmqMissing } from '../helpers';

const SCRIPT = path.join(FIXTURES, 'vllm_side_channel.py');

const missing = pythonZmqMissing();
if (missing) console.warn(`interop tests skipped: ${missing}`);

function runPython(args: string[]): Promise<string> {
  return new Promise<string>((resolve, reject) => {
    const p = spawn(PY, [SCRIPT, ...args]);
    let s = '';
    p.stdout.on('data', (d) => (s += d));
    p.stderr.on('data', (d) => (s += d));
    p.on('exit', (code) => (code === 0 ? resolve(s) : reject(new Error(s))));
  });
}

/** A Python listener, with everything it printed (SERVED pp tp / DIED ...). */
function pythonListener(args: string[]): Promise<{ port: number; p: ChildProcess; out: () => string }> {
  return onFreePort((port) => startPython(port, args));
}

async function startPython(
  port: number,
  args: string[],
): Promise<{ port: number; p: ChildProcess; out: () => string }> {
  const p = spawn(PY, [SCRIPT, 'listen', String(port), ...args]);
  let out = '';
  p.stdout!.on('data', (d) => (out += d));
  p.stderr!.on('data', (d) => (out += d));
  await new Promise<void>((resolve, reject) => {
    const t = setInterval(() => {
      if (out.includes('READY')) {
        clearInterval(t);
        resolve();
      }
    }, 10);
    p.once('exit', (c) => {
      clearInterval(t);
      reject(new Error(`python exited ${c}: ${out}`));
    });
  });
  return { port, p, out: () => out };
}

describe.skipIf(missing !== undefined)('vLLM (Python) interop over ZMQ, wire v0.13', () => {
  it('a vLLM decode worker reads our listener', async () => {
    const meta = {
      engineId: 'node-prefill',
      agentMetadata: Buffer.from([0, 1, 2, 250]),
      kvCachesBaseAddr: [0x7fab00000000n, 4096n],
      deviceId: 2,
      numBlocks: 777,
      blockLens: [16384, 16384],
      kvCacheLayout: 'NHD' as const,
      blockSize: 32,
    };
    const hash = 'd'.repeat(64);
    const server = await zmqHandshake.serve({
      port: 0,
      wire: 'v0.13',
      payloads: new Map([[2, { compatibilityHash: hash, agentMetadataBytes: encodeAgentMetadata(meta, 'v0.13') }]]),
    });
    try {
      const out = await new Promise<string>((resolve, reject) => {
        const p = spawn(PY, [SCRIPT, 'fetch', String(server.port), '2']);
        let s = '';
        p.stdout.on('data', (d) => (s += d));
        p.stderr.on('data', (d) => (s += d));
        p.on('exit', (code) => (code === 0 ? resolve(s) : reject(new Error(s))));
      });
      const got = JSON.parse(out);
      expect(got.compatibility_hash).toBe(hash);
      expect(got.meta).toEqual({
        engine_id: 'node-prefill',
        agent_metadata: '000102fa',
        kv_caches_base_addr: [String(0x7fab00000000n), '4096'],
        device_id: 2,
        num_blocks: 777,
        block_lens: [16384, 16384],
        kv_cache_layout: 'NHD',
        block_size: 32,
      });
    } finally {
      await server.close();
    }
  });

  it('we read a vLLM prefill listener', async () => {
    const { port, p } = await pythonListener([]);
    try {
      const hash = createHash('sha256').update('py').digest('hex');
      for (const r of [0, 1]) {
        const got = await zmqHandshake.fetch({
          host: '127.0.0.1',
          port,
          tpRank: r,
          expectedHash: hash,
          timeoutMs: 10_000,
          wire: 'v0.13',
        });
        expect(got.metadata).toMatchObject({
          engineId: 'vllm-prefill',
          agentMetadata: Buffer.from(`py-agent-${r}`),
          kvCachesBaseAddr: [0x7f0000000000n + BigInt(r) * 0x10000000n, 0x7f1000000000n],
          deviceId: r,
          numBlocks: 4096,
          blockLens: [65536, 65536],
          blockStrides: [65536, 65536],
          kvCacheLayout: 'LBHNC',
          blockSize: 16,
        });
      }
    } finally {
      p.kill();
    }
  });
});

const V12_KEYS = [
  'engine_id',
  'agent_metadata',
  'kv_caches_base_addr',
  'device_id',
  'num_blocks',
  'block_lens',
  'block_strides',
  'kv_cache_layout',
  'block_size',
  'ssm_sizes',
  'attn_backend_name',
  'physical_blocks_per_logical_kv_block',
  'region_num_blocks',
  'region_group_ids',
  'region_names',
  'region_mem_types',
  'dcp_size',
  'pcp_size',
  'region_members',
];

describe.skipIf(missing !== undefined)('vLLM (Python) interop over ZMQ, wire v12', () => {
  it('a vLLM v12 decode worker (typed decode, 2-frame assert) reads every (pp, tp) of our listener', async () => {
    const hash = 'e'.repeat(64);
    const md = (pp: number, tp: number) =>
      encodeAgentMetadata(
        {
          engineId: 'node-prefill',
          agentMetadata: Buffer.from([pp, tp, 250]),
          kvCachesBaseAddr: [0xffff_0000_0000_0000n + BigInt(tp), 4096n],
          deviceId: tp,
          numBlocks: 777,
          blockLens: [16384, 16384],
          blockStrides: [16384, 32768],
          kvCacheLayout: 'LBNHC',
          blockSize: 32,
          attnBackendName: 'FLASHINFER',
          regionNames: ['model.layers.0.self_attn', 'model.layers.1.self_attn'],
        },
        'v12',
      );
    const payloads = [0, 1].flatMap((pp) =>
      [0, 1].map((tp) => ({
        ppRank: pp,
        tpRank: tp,
        payload: { compatibilityHash: hash, agentMetadataBytes: md(pp, tp) },
      })),
    );
    const server = await zmqHandshake.serve({ port: 0, wire: 'v12', payloads });
    try {
      for (const [pp, tp] of [
        [0, 0],
        [1, 1],
      ]) {
        const got = JSON.parse(
          await runPython(['fetch', String(server.port), '--wire', 'v12', '--pp', String(pp), '--tp', String(tp)]),
        );
        expect(got.compatibility_hash).toBe(hash);
        expect(got.keys).toEqual(V12_KEYS);
        expect(got.meta).toMatchObject({
          engine_id: 'node-prefill',
          agent_metadata: Buffer.from([pp, tp, 250]).toString('hex'),
          kv_caches_base_addr: [String(0xffff_0000_0000_0000n + BigInt(tp)), '4096'],
          block_strides: [16384, 32768],
          kv_cache_layout: 'LBNHC',
          ssm_sizes: [0, 0],
          attn_backend_name: 'FLASHINFER',
          physical_blocks_per_logical_kv_block: 1,
          region_group_ids: null,
          region_names: ['model.layers.0.self_attn', 'model.layers.1.self_attn'],
          dcp_size: 1,
          pcp_size: 1,
          region_members: [],
        });
        // Python's perf_counter and our performance.now() have different origins: only finite.
        expect(Number.isFinite(got.clock_offset)).toBe(true);
        expect(got.rtt).toBeGreaterThan(0);
      }
    } finally {
      await server.close();
    }
  });

  it('we read a vLLM v12 listener: every (pp, tp), 2 frames, clock offset', async () => {
    const py = await pythonListener(['--wire', 'v12', '--tp', '2', '--pp', '2']);
    try {
      const hash = createHash('sha256').update('py').digest('hex');
      for (const [pp, tp] of [
        [0, 1],
        [1, 0],
      ]) {
        const got = await zmqHandshake.fetch({
          host: '127.0.0.1',
          port: py.port,
          ppRank: pp,
          tpRank: tp,
          expectedHash: hash,
          wire: 'v12',
        });
        expect(got.metadata).toMatchObject({
          engineId: 'vllm-prefill',
          agentMetadata: Buffer.from(`py-agent-${pp}-${tp}`),
          kvCachesBaseAddr: [
            0xffff000000000000n + BigInt(pp) * 0x100000000n + BigInt(tp) * 0x10000000n,
            0x7f1000000000n,
          ],
          blockStrides: [65536, 131072],
          kvCacheLayout: 'LBHNC',
          regionNumBlocks: [4096, 2048],
          regionMemTypes: ['DRAM', 'DRAM'],
          regionGroupIds: null,
        });
        expect(Number.isFinite(got.clockOffsetS)).toBe(true);
        expect(got.remoteSeconds).toBeGreaterThan(0);
      }
      expect(py.out()).not.toMatch(/DIED/);
    } finally {
      py.p.kill();
    }
  });

  it('a KvPuller asks a vLLM v12 listener only for ranks that exist, so it stays up', async () => {
    // P: TP 2 x PP 2, two regions per pipeline rank. D: TP 1 reads both TP ranks of both pipeline ranks.
    const py = await pythonListener(['--wire', 'v12', '--tp', '2', '--pp', '2']);
    const agent = new NixlAgent('D-interop');
    const hash = createHash('sha256').update('py').digest('hex');
    try {
      const buf = allocate(8 * 131072 * 2);
      agent.registerMemory(buf);
      const base = DescList.from(buf).addr(0);
      const puller = new KvPuller({
        agent,
        wire: 'v12',
        expectedHash: hash,
        layout: {
          engineId: 'D',
          tpSize: 1,
          tpRank: 0,
          numBlocks: 2,
          blockSize: 16,
          blockLens: [131072, 131072, 131072, 131072],
          blockStrides: [131072, 262144, 131072, 262144],
          baseAddrs: [base, base + 131072n, base + 4n * 131072n, base + 5n * 131072n],
          kvCacheLayout: 'LBHNC',
          totalNumKvHeads: 8,
        },
      });
      const err = await puller
        .pullFromParams(
          {
            do_remote_prefill: true,
            remote_block_ids: [[0, 1]],
            remote_engine_id: 'vllm-prefill',
            remote_request_id: 'req-1',
            remote_host: '127.0.0.1',
            remote_port: py.port,
            tp_size: 2,
            pp_size: 2,
          },
          { localBlockIds: [0, 1] },
        )
        .catch((e) => e);
      // The handshake and every check passed; the Python agent metadata is no NIXL agent.
      expect(err).toBeInstanceOf(PullError);
      expect(err.kind).toBe('setup');
      // Python prints after its reply went out: wait for the lines, not only the replies.
      const served = () =>
        py
          .out()
          .match(/SERVED \d+ \d+/g)
          ?.sort() ?? [];
      await expect.poll(served).toEqual(['SERVED 0 0', 'SERVED 0 1', 'SERVED 1 0', 'SERVED 1 1']);
      expect(py.out()).not.toMatch(/DIED/);
      // It still answers.
      const again = await zmqHandshake.fetch({ host: '127.0.0.1', port: py.port, ppRank: 1, tpRank: 1, wire: 'v12' });
      expect(decodeAgentMetadata(encodeAgentMetadata(again.metadata, 'v12'), 'v12').engineId).toBe('vllm-prefill');
      await puller.close();
    } finally {
      py.p.kill();
      agent.close();
    }
  });

  it('our peer dies on a v0.13 request as vLLM v12 does, which is why the default profile is v12', async () => {
    const py = await pythonListener(['--wire', 'v12', '--tp', '1']);
    try {
      await expect(
        zmqHandshake.fetch({ host: '127.0.0.1', port: py.port, tpRank: 0, wire: 'v0.13', timeoutMs: 300, retries: 0 }),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
      await expect.poll(() => py.out()).toMatch(/DIED ValueError/);
      await expect(
        zmqHandshake.fetch({ host: '127.0.0.1', port: py.port, tpRank: 0, wire: 'v12', timeoutMs: 300, retries: 0 }),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
    } finally {
      py.p.kill();
    }
  });
});
