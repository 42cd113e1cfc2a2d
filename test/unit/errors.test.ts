// One error rule: bad input anywhere in the library is a NixlError with
// code NIXL_ERR_INVALID_PARAM (never a bare RangeError), and each code has
// its own status number (NIXL_ERR_TIMEOUT is not NIXL_ERR_CANCELED's).
import { afterEach, expect, it } from 'vitest';
import { NixlAgent, NixlError, PrefillTracker, Status, createHandshake, startProxy } from '../../lib';
import { checkRank } from '../../lib/handshake/types';
import { LeaseBoard } from '../../lib/kv';
import { stateHeader } from '../../lib/serving/models/kv-state';
import { TINY, buildGguf } from '../../lib/serving/models/test-models';

const agents: NixlAgent[] = [];
afterEach(() => {
  for (const a of agents.splice(0)) a.close();
});

function invalidParam(f: () => unknown): NixlError {
  let caught: unknown;
  try {
    f();
  } catch (e) {
    caught = e;
  }
  expect(caught).toBeInstanceOf(NixlError);
  expect((caught as NixlError).code).toBe('NIXL_ERR_INVALID_PARAM');
  expect((caught as NixlError).status).toBe(Status.NIXL_ERR_INVALID_PARAM);
  return caught as NixlError;
}

it('bad input is NIXL_ERR_INVALID_PARAM wherever the library refuses it', async () => {
  const agent = new NixlAgent('errors-a', { engine: 'loopback' });
  agents.push(agent);
  invalidParam(() => createHandshake('grpc' as 'zmq'));
  invalidParam(() => checkRank('tp_rank', 70_000));
  invalidParam(() => new LeaseBoard(3));
  invalidParam(() => new PrefillTracker({ agent, tpSize: 1, leaseMs: 0 }));
  const tracker = new PrefillTracker({ agent, tpSize: 1, leaseMs: 60_000 });
  void tracker.expect('r1', [1]);
  invalidParam(() => tracker.expect('r1', [2]));
  void tracker.close();
  invalidParam(() =>
    stateHeader(Buffer.alloc(4), { fingerprint: Buffer.alloc(31), tokens: 1 } as Parameters<typeof stateHeader>[1]),
  );
  invalidParam(() => buildGguf({ ...TINY, heads: 3 }));
  const proxy = await startProxy({ prefill: [], decode: [] }).catch((e: unknown) => e);
  expect(proxy).toBeInstanceOf(NixlError);
  expect((proxy as NixlError).code).toBe('NIXL_ERR_INVALID_PARAM');
});

it('NIXL_ERR_TIMEOUT has its own status, not NIXL_ERR_CANCELED -11, and maps back to its code', async () => {
  const agent = new NixlAgent('errors-b', { engine: 'loopback' });
  agents.push(agent);
  const e = (await agent.waitForNotif(() => false, { timeoutMs: 5 }).catch((x: unknown) => x)) as NixlError;
  expect(e).toBeInstanceOf(NixlError);
  expect(e.code).toBe('NIXL_ERR_TIMEOUT');
  expect(e.status).not.toBe(Status.NIXL_ERR_CANCELED);
  expect(Object.values(Status)).not.toContain(e.status);
  expect(NixlError.fromStatus(e.status, 'x').code).toBe('NIXL_ERR_TIMEOUT');
  // Made anywhere else (a side channel's timeout), the same number.
  expect(new NixlError('x', 'NIXL_ERR_TIMEOUT').status).toBe(e.status);
});
