// Push mode against a vLLM-format peer of our own in Python (msgpack:
// Debian python3-msgpack; .ci/run installs it), without NIXL: the
// registration bytes vLLM's push scheduler builds equal ours, vLLM's push
// worker reads ours (nixl-node's extra keys included) as we meant them, and
// the hash and WRITE notification agree.
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import { describe, expect, it } from 'vitest';
import { computeCompatibilityHash } from '../../lib/handshake';
import { type PushRegistration, encodePushReg, writeNotif } from '../../lib/kv/push/reg';
import { FIXTURES } from '../helpers';

const PY = '/usr/bin/python3';
const SCRIPT = path.join(FIXTURES, 'vllm_push_peer.py');

function pythonReady(): boolean {
  try {
    execFileSync(PY, ['-c', 'import msgpack'], { stdio: 'pipe' });
    return true;
  } catch {
    console.warn(
      'push interop tests skipped: /usr/bin/python3 with msgpack not found (apt-get install python3-msgpack)',
    );
    return false;
  }
}

const py = (...args: string[]) => execFileSync(PY, [SCRIPT, ...args], { encoding: 'utf8' }).trim();

const toPy = (r: PushRegistration) => ({
  request_id: r.requestId,
  decode_engine_id: r.decodeEngineId,
  decode_host: r.decodeHost,
  decode_port: r.decodePort,
  decode_tp_size: r.decodeTpSize,
  local_block_ids: r.localBlockIds,
  remote_engine_id: r.remoteEngineId,
  remote_host: r.remoteHost,
  remote_port: r.remotePort,
  remote_tp_size: r.remoteTpSize,
  remote_pp_size: r.remotePpSize,
});

function sample(i: number): PushRegistration {
  return {
    requestId: `cmpl-${'x'.repeat(i * 13)}-${(0x10000000 + i).toString(16)}`,
    decodeEngineId: `dec-${i}`,
    decodeHost: i % 2 ? '::1' : '127.0.0.1',
    decodePort: 5600 + i * 997,
    decodeTpSize: [1, 2, 4, 8][i % 4],
    localBlockIds: [Array.from({ length: 1 + i * 37 }, (_, k) => (k * 7919 + i) % 70000)],
    remoteEngineId: `pre-${i}`,
    remoteHost: '127.0.0.2',
    remotePort: 65535 - i,
    remoteTpSize: [1, 4, 2, 1][i % 4],
    remotePpSize: 1 + (i % 3),
  };
}

describe.skipIf(!pythonReady())('push interop with a vLLM-format peer (Python msgpack)', () => {
  it("registrations: vLLM's push scheduler's bytes are ours, for ids, sizes and lists of every width", () => {
    for (let i = 0; i < 8; i++) {
      const r = sample(i);
      expect(encodePushReg(r).toString('hex'), `registration ${i}`).toBe(py('reg', JSON.stringify(toPy(r))));
    }
  });

  it("vLLM's push worker reads ours, extra keys and signature included, as the same registration", () => {
    for (let i = 0; i < 4; i++) {
      const r = sample(i);
      const signed = encodePushReg({ ...r, confirm: true, deadlineMs: 1234 }, 'secret');
      expect(JSON.parse(py('parse', signed.toString('hex')))).toEqual(toPy(r));
    }
    // What it drops, it drops (and nixl-node's prefill refuses the same: test/unit/push-wire.test.ts).
    expect(py('parse', Buffer.from('PUSH_REG:\xc1', 'latin1').toString('hex'))).toMatch(/^DROPPED undecodable/);
    expect(py('parse', Buffer.from('PUSH_REG:\x93\x01\x02\x03', 'latin1').toString('hex'))).toBe(
      'DROPPED missing request_id',
    );
  });

  it('the compatibility hash in both modes and the WRITE notification agree', () => {
    for (const mode of ['pull', 'push'] as const) {
      const f = {
        vllmVersion: '0.26.0',
        model: 'demo/llama-tiny',
        dtype: 'torch.bfloat16',
        numKvHeads: 8,
        headSize: 128,
        numHiddenLayers: 4,
        attnBackendName: 'FLASH_ATTN',
        cacheDtype: 'auto',
        isHmaEnabled: false,
        speculativeConfig: null,
        transferMode: mode,
      };
      const factors = {
        vllm_version: f.vllmVersion,
        nixl_connector_version: 12,
        model: f.model,
        dtype: f.dtype,
        num_kv_heads: f.numKvHeads,
        head_size: f.headSize,
        num_hidden_layers: f.numHiddenLayers,
        attn_backend_name: f.attnBackendName,
        cache_dtype: f.cacheDtype,
        is_hma_enabled: false,
        speculative_config: null,
        transfer_mode: mode,
      };
      expect(computeCompatibilityHash(f, 'v12')).toBe(py('hash', JSON.stringify(factors)));
    }
    expect(Buffer.from(writeNotif('cmpl-r1-0a1b2c3d', 4)).toString('hex')).toBe(py('write', 'cmpl-r1-0a1b2c3d', '4'));
  });
});
