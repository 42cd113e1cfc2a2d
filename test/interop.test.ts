// Interop with vLLM's own side of the ZMQ handshake, run by Python's msgpack
// and pyzmq (Debian python3-msgpack, python3-zmq; .ci/run installs them).
import { execFileSync, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
import { encodeAgentMetadata, zmqHandshake } from '../lib/handshake';
import { FIXTURES, freePort } from './helpers';

const PY = '/usr/bin/python3';
const SCRIPT = path.join(FIXTURES, 'vllm_side_channel.py');

function pythonReady(): string | undefined {
  try {
    execFileSync(PY, ['-c', 'import msgpack, zmq'], { stdio: 'pipe' });
    return undefined;
  } catch {
    return `${PY} with msgpack and zmq not found (apt-get install python3-msgpack python3-zmq)`;
  }
}

const missing = pythonReady();
if (missing) console.warn(`interop tests skipped: ${missing}`);

describe.skipIf(missing !== undefined)('vLLM (Python) interop over ZMQ', () => {
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
      payloads: new Map([[2, { compatibilityHash: hash, agentMetadataBytes: encodeAgentMetadata(meta) }]]),
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
    const port = await freePort();
    const p = spawn(PY, [SCRIPT, 'listen', String(port)]);
    try {
      await new Promise<void>((resolve, reject) => {
        p.stdout.once('data', (d) => (String(d).includes('READY') ? resolve() : reject(new Error(String(d)))));
        p.once('exit', (c) => reject(new Error(`python exited ${c}`)));
      });
      const hash = createHash('sha256').update('py').digest('hex');
      for (const r of [0, 1]) {
        const got = await zmqHandshake.fetch({
          host: '127.0.0.1',
          port,
          tpRank: r,
          expectedHash: hash,
          timeoutMs: 10_000,
        });
        expect(got.metadata).toEqual({
          engineId: 'vllm-prefill',
          agentMetadata: Buffer.from(`py-agent-${r}`),
          kvCachesBaseAddr: [0x7f0000000000n + BigInt(r) * 0x10000000n, 0x7f1000000000n],
          deviceId: r,
          numBlocks: 4096,
          blockLens: [65536, 65536],
          kvCacheLayout: 'HND',
          blockSize: 16,
        });
      }
    } finally {
      p.kill();
    }
  });
});
