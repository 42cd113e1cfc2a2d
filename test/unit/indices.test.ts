// Block indices given as numbers: each must name one entry of a prepared list.
// A fraction, NaN, a negative number or one of 2^32 and above used to be
// converted (Uint32Array.from: 2^32 + 1 -> 1, 1.5 -> 1, NaN -> 0), so a
// request silently moved another block; each is refused now, with its place.
import { afterEach, expect, it } from 'vitest';
import { DescList, NixlAgent } from '../../lib';

let a: NixlAgent | undefined;
let b: NixlAgent | undefined;
afterEach(() => {
  a?.close();
  b?.close();
  a = b = undefined;
});

function lists() {
  a = new NixlAgent('idx-a', { engine: 'loopback' });
  b = new NixlAgent('idx-b', { engine: 'loopback' });
  const blocks = (agent: NixlAgent) => {
    const mem = Buffer.alloc(4 * 4096);
    agent.registerMemory(mem);
    const base = DescList.from(mem).addr(0);
    return DescList.from(Array.from({ length: 4 }, (_, i) => ({ addr: base + BigInt(i * 4096), len: 4096 })));
  };
  const mine = blocks(a);
  const theirs = blocks(b);
  a.addRemoteAgent(b.getAgentMetadata());
  return { local: a.prepXferDlist('NIXL_INIT_AGENT', mine), remote: a.prepXferDlist('idx-b', theirs) };
}

it('makePreppedXfer and makeLayeredXfer refuse indices that are not integers in [0, 2^32), naming the place', () => {
  const { local, remote } = lists();
  for (const bad of [2 ** 32 + 1, 1.5, Number.NaN, -1, Number.POSITIVE_INFINITY, '1' as unknown as number]) {
    expect(() => a!.makePreppedXfer('WRITE', local, [0, bad], remote, [0, 1]), String(bad)).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM', message: expect.stringContaining('[1]') }),
    );
    expect(() => a!.makePreppedXfer('WRITE', local, [0, 1], remote, [bad, 1]), String(bad)).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
    expect(() => a!.makeLayeredXfer('WRITE', local, [[0], [bad]], remote, [[0], [1]]), String(bad)).toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
  }
  // Good ones still make requests, as arrays and as Uint32Array.
  a!.releaseXferHandle(a!.makePreppedXfer('WRITE', local, [0, 3], remote, new Uint32Array([1, 2])));
});
