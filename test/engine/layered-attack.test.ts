// Layered transfers and completions under misuse and races: waits that must
// settle with the posting they were made in, bad input answered with a code.
// Loopback only where the engine's test delay makes the race deterministic.
import { afterEach, describe, expect, it } from 'vitest';
import { DescList, NixlAgent, type NixlError } from '../../lib';
import { allocate } from '../../lib';

const BLOCK = 4096;
const N = 8;
const open: NixlAgent[] = [];
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

function setup(testDelayUs?: number) {
  const a = new NixlAgent('atk-a', testDelayUs ? { engine: 'loopback', testDelayUs } : { engine: 'loopback' });
  const b = new NixlAgent('atk-b', { engine: 'loopback' });
  open.push(a, b);
  const ma = allocate(N * BLOCK);
  const mb = allocate(N * BLOCK);
  a.registerMemory(ma);
  b.registerMemory(mb);
  a.addRemoteAgent(b.getAgentMetadata());
  const blocks = (m: Buffer) =>
    DescList.from(Array.from({ length: N }, (_, i) => m.subarray(i * BLOCK, (i + 1) * BLOCK)));
  const local = a.prepXferDlist('NIXL_INIT_AGENT', blocks(ma));
  const remote = a.prepXferDlist('atk-b', blocks(mb));
  return { a, b, ma, mb, local, remote };
}

/** Blocks this thread (the engine's thread keeps running): no event is delivered meanwhile. */
const block = (ms: number): void => {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
};
const settledWithin = <T>(p: Promise<T>, ms: number): Promise<string> =>
  Promise.race([
    p.then(
      () => 'resolved',
      (e: NixlError) => `rejected ${e.code}`,
    ),
    new Promise<string>((r) => setTimeout(() => r('pending'), ms)),
  ]);

describe('layered transfers under attack (loopback)', () => {
  it('a wait made in one posting settles with it, even when another wait() found the posting done first and the handle is posted again at once', async () => {
    const { a, ma, mb, local, remote } = setup(2000);
    mb.fill(9);
    const h = a.makeLayeredXfer('READ', local, [[0], [1]], remote, [[0], [1]]);
    a.postLayer(h, 0);
    a.postLayer(h, 1);
    const first = a.wait(h);
    // Both layers finish on the engine's thread (their bytes land, then their
    // state is set); their completion events wait for this thread.
    for (let i = 0; i < 500 && ma[2 * BLOCK - 1] !== 9; i++) block(10);
    block(50);
    // A second wait asks the request's state, which finds the posting done.
    void a.wait(h);
    // The next posting starts here, before the first posting's event is delivered.
    expect(a.postLayer(h, 0)).toBe('PROC');
    // The first wait belongs to the finished posting: it must not wait for this one.
    expect(await settledWithin(first, 2000)).toBe('resolved');
  });

  it('makeLayeredXfer: a layer list with a hole is NIXL_ERR_INVALID_PARAM, not a TypeError', () => {
    const { a, local, remote } = setup();
    // biome-ignore lint/suspicious/noSparseArray: the hole is the bad input under test
    const holey = [[0], , [1]] as unknown as number[][];
    let code: string | undefined;
    try {
      a.makeLayeredXfer('READ', local, holey, remote, [[0], [1], [2]]);
    } catch (e) {
      code = (e as NixlError).code;
    }
    expect(code).toBe('NIXL_ERR_INVALID_PARAM');
  });
});
