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

it('makePreppedXfer refuses indices that are not a list (null, a number, an object, a bad length) with a code, never an empty transfer', () => {
  const { local, remote } = lists();
  // A number or a plain object used to read as a list of length 0: both sides "empty", a transfer that moved nothing.
  for (const bad of [null, undefined, 5, {}, { length: -1 }, { length: 2 ** 33 }, { length: 2, 0: 0, 1: 1 }]) {
    const idx = bad as unknown as number[];
    expect(() => a!.makePreppedXfer('WRITE', local, idx, remote, idx), JSON.stringify(bad) ?? 'undefined').toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
    expect(() => a!.makePreppedXfer('WRITE', local, [0], remote, idx), JSON.stringify(bad) ?? 'undefined').toThrow(
      expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
    );
  }
  // Typed arrays of other kinds are checked entry by entry, as arrays are.
  a!.releaseXferHandle(a!.makePreppedXfer('WRITE', local, new Float64Array([0, 3]), remote, new Int32Array([1, 2])));
  expect(() => a!.makePreppedXfer('WRITE', local, new Int32Array([0, -1]), remote, [0, 1])).toThrow(
    expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM', message: expect.stringContaining('[1]') }),
  );
});
