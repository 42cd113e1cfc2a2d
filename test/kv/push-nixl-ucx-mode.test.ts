// Push mode over UCX TCP between a nixl-node agent on NIXL's default
// ucx_error_handling_mode (peer, as vLLM's agents) and a vLLM-format Python
// peer on NIXL's Python API with ucx_error_handling_mode=none. UCX refuses
// the second endpoint between them ("error handling level mismatch") and NIXL
// says only NIXL_ERR_BACKEND: the side that connects second fails to load the
// other's metadata. The nixl-node side must fail at that step, naming the
// setting, not wait out its deadline: the prefill when its handshake back
// fails, the decode as soon as the prefill that failed it is unreachable.
// Skipped, saying why, without NIXL.
import { describe, expect, it } from 'vitest';
import { engines } from '../../lib';
import { nixlRank, open, pyPeer, pyPrefillToRank, pythonNixlMissing, rankReceiver, rankSender } from './nixl-py-peer';
import { PUSH_HASH } from './push-helpers';

// UCX reads UCX_TLS once, when NIXL first loads it: this file's process runs over TCP on 127.0.0.1.
process.env.UCX_TLS = 'tcp,self';
const PEER_ENV = { UCX_TLS: 'tcp,self', PEER_UCX_ERROR_HANDLING_MODE: 'none' };
/** Each side's deadline; a failure at the failing step comes long before it. */
const DEADLINE_MS = 40_000;

const why = pythonNixlMissing();
if (why) console.warn(`push over NIXL with mismatched UCX error handling skipped: ${why}`);

describe.skipIf(why !== undefined)('push over UCX TCP with a peer on another ucx_error_handling_mode', () => {
  it(
    'a nixl-node prefill (peer) fails the offer when a Python decode (none) registers, naming the setting',
    async () => {
      const p = await nixlRank('mode-p', 'P', 3);
      // Created with NIXL's default: no ucx_error_handling_mode given (UCX_TLS has tcp).
      expect(p.agent.getBackendParams('UCX').params.ucx_error_handling_mode ?? 'peer').toBe('peer');
      const sender = rankSender(p, DEADLINE_MS);
      const id = 'cmpl-mode-0a1b2c3d';
      const py = pyPeer(['decode', String(p.server.basePort), PUSH_HASH, 'P', id, '5,6,7'], PEER_ENV);
      open.push(() => py.p.kill());
      const t0 = performance.now();
      const sent = await sender.offer(id, [1, 2, 3]);
      const ms = performance.now() - t0;
      expect(sent.reason, py.output()).toBe('failed');
      expect(sent.error).toMatchObject({ code: 'NIXL_ERR_BACKEND', message: expect.stringMatching(/loadRemoteMD/) });
      expect(sent.error?.message).toMatch(
        /ucx_error_handling_mode cannot connect \(this agent: peer; NIXL's default and vLLM's agents: peer/,
      );
      // Failed at the handshake back, not at the lease's end.
      expect(ms).toBeLessThan(DEADLINE_MS / 2);
    },
    2 * DEADLINE_MS,
  );

  it(
    'a nixl-node decode (peer) fails the receive when a Python prefill (none) cannot connect back, naming the setting',
    async () => {
      const { py, receiver, params } = await pyPrefillToRank('mode-d', DEADLINE_MS, PEER_ENV);
      const t0 = performance.now();
      const err = await receiver
        .receive(params, { requestId: 'cmpl-mode-q-0a1b2c3d', localBlockIds: [9, 10, 11] })
        .then(
          () => undefined,
          (e: Error) => e,
        );
      const ms = performance.now() - t0;
      expect((await py.line(/^HANDSHAKE_FAILED (\S+)$/))[1]).toBe('NIXL_ERR_BACKEND');
      expect(err, py.output()).toMatchObject({
        name: 'PushError',
        kind: 'peer-gone',
        code: 'NIXL_ERR_REMOTE_DISCONNECT',
      });
      expect(err?.message).toMatch(/ucx_error_handling_mode cannot connect \(this agent: peer/);
      // Failed once the prefill could not be reached, not at the deadline.
      expect(ms).toBeLessThan(DEADLINE_MS / 2);
    },
    2 * DEADLINE_MS,
  );
});

describe.skipIf(!engines.includes('nixl'))('push over UCX TCP between nixl-node ranks on different modes', () => {
  it(
    'the decode (none) refuses the prefill (peer) at the handshake, naming the setting, before registering',
    async () => {
      const p = await nixlRank('mode2-p', 'P', 3);
      const d = await nixlRank('mode2-d', 'D', 0, 'none');
      const sender = rankSender(p, DEADLINE_MS);
      const receiver = rankReceiver(d, DEADLINE_MS);
      const offered = sender.offer('cmpl-mode2-0a1b2c3d', [1, 2]);
      const t0 = performance.now();
      const err = await receiver
        .receive(
          {
            do_remote_prefill: true,
            remote_engine_id: 'P',
            remote_request_id: 'cmpl-mode2-0a1b2c3d',
            remote_host: '127.0.0.1',
            remote_port: p.server.basePort,
            tp_size: 1,
            pp_size: 1,
          },
          { requestId: 'cmpl-mode2-0a1b2c3d', localBlockIds: [5, 6] },
        )
        .then(
          () => undefined,
          (e: Error) => e,
        );
      expect(err).toMatchObject({ name: 'PushError', kind: 'mismatch', code: 'NIXL_ERR_MISMATCH' });
      expect(err?.message).toMatch(/runs ucx_error_handling_mode peer: .*\(this agent: none;/);
      expect(performance.now() - t0).toBeLessThan(DEADLINE_MS / 2);
      // Nothing registered: no blocks in quarantine, and the prefill never saw a registration.
      expect(receiver.resources()).toMatchObject({ receiving: 0, quarantined: 0 });
      expect(sender.pending.registrations).toBe(0);
      expect(sender.abort('cmpl-mode2-0a1b2c3d')).toBe(true);
      expect((await offered).reason).toBe('aborted');
    },
    2 * DEADLINE_MS,
  );
});
