// Handles far into an agent's life: an agent that makes 1,000 requests a
// second has made 2^31 handles in 25 days, 2^32 in 50. Its transfers (READ
// and WRITE, prepped and layered, posted inline and from the engine's thread)
// keep moving the right bytes with handles past 2^31 and 2^32, every handle
// distinct; an agent whose counter reaches the end of the engines' range
// refuses new handles with NIXL_ERR_NOT_ALLOWED, and what it made still works.
// testFirstHandle starts the counter there instead of making billions.
// NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { expect, it } from 'vitest';
import { type AgentOptions, NixlAgent, type NixlError, allocate } from '../../lib';
import { eachEngine, preparedBlocks } from '../helpers';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const { setupAgent } = require('../fixtures/conformance-setup');

const BLOCK = 4096;
const LAYERS = 4;
const N = 2 * LAYERS;
/** Engine handles stay below 2^52 (docs/agent-api.md); layered ids live in [2^52, 2^53). */
const ENGINE_LIMIT = 2 ** 52;

const mark = (seed: number, b: number): number => (seed * 37 + b * 11 + 1) & 0xff;
function fill(mem: Buffer, seed: number): void {
  for (let b = 0; b < N; b++) mem.fill(mark(seed, b), b * BLOCK, (b + 1) * BLOCK);
}
/** The blocks of `mem` that do not hold want(b) in every byte. */
function wrongBlocks(mem: Buffer, want: (b: number) => number): number[] {
  const out: number[] = [];
  for (let b = 0; b < N; b++) if (mem.subarray(b * BLOCK, (b + 1) * BLOCK).some((x) => x !== want(b))) out.push(b);
  return out;
}
/** Local block i <-> remote block perm[i]. */
const perm = Array.from({ length: N }, (_, i) => (i * 3 + 5) % N);
const ALL = Array.from({ length: N }, (_, i) => i);
const localLayers = Array.from({ length: LAYERS }, (_, l) => [l, l + LAYERS]);
const remoteLayers = localLayers.map((idx) => idx.map((i) => perm[i]));
const codeOf = (f: () => unknown): string | undefined => {
  try {
    f();
  } catch (e) {
    return `${(e as NixlError).code}: ${(e as Error).message}`;
  }
  return undefined;
};

eachEngine('handles past 2^31 and 2^32: %s engine', (engine, open) => {
  function agent(name: string, extra: AgentOptions): NixlAgent {
    const a: NixlAgent =
      engine === 'nixl'
        ? new NixlAgent(name, {
            engine,
            progressThread: true,
            progressDelayUs: 1000,
            backendParams: { UCX: { ucx_error_handling_mode: 'none' } },
            ...extra,
          })
        : setupAgent(NixlAgent, name, engine, extra);
    open.push(a);
    return a;
  }

  it.each([
    [2 ** 31, 'inline'],
    [2 ** 31, 'engine-thread'],
    [2 ** 32, 'inline'],
    [2 ** 32, 'engine-thread'],
  ])('across %d (%s posts): READ and WRITE, prepped and layered, move the right bytes', async (edge, how) => {
    const posts: AgentOptions = how === 'inline' ? {} : { inlinePostMaxBytes: 0 };
    // a's registration and its two lists take edge - 4 .. edge - 2: its first request is edge - 1.
    const a = agent('hnd-a', { testFirstHandle: edge - 4, ...posts });
    const b = agent('hnd-b', { testFirstHandle: edge - 1 });
    const { ma, mb, local, remote } = preparedBlocks(a, b, N, BLOCK);
    const ids = [local.id, remote.id];
    for (let round = 0; round < 2; round++) {
      const seed = 10 * round;
      fill(mb, seed + 1);
      fill(ma, seed + 2);
      const read = a.makePreppedXfer('READ', local, ALL, remote, perm);
      ids.push(read.id);
      a.transfer(read);
      await a.wait(read, { timeoutMs: 10_000 });
      expect(wrongBlocks(ma, (i) => mark(seed + 1, perm[i]))).toEqual([]);

      fill(ma, seed + 3);
      const write = a.makePreppedXfer('WRITE', local, ALL, remote, perm, 'prepped');
      ids.push(write.id);
      a.transfer(write);
      await a.wait(write, { timeoutMs: 10_000 });
      expect(wrongBlocks(mb, (r) => mark(seed + 3, perm.indexOf(r)))).toEqual([]);
      expect((await b.waitForNotif({ agent: 'hnd-a' }, { timeoutMs: 10_000 })).msg.toString()).toBe('prepped');

      fill(mb, seed + 4);
      const lread = a.makeLayeredXfer('READ', local, localLayers, remote, remoteLayers);
      ids.push(lread.id);
      for (let l = 0; l < LAYERS; l++) a.postLayer(lread, l);
      await a.wait(lread, { timeoutMs: 10_000 });
      expect(wrongBlocks(ma, (i) => mark(seed + 4, perm[i]))).toEqual([]);

      fill(ma, seed + 5);
      const lwrite = a.makeLayeredXfer('WRITE', local, localLayers, remote, remoteLayers, 'layered');
      ids.push(lwrite.id);
      for (let l = 0; l < LAYERS; l++) a.postLayer(lwrite, l);
      await a.wait(lwrite, { timeoutMs: 10_000 });
      expect((await b.waitForNotif({ agent: 'hnd-a' }, { timeoutMs: 10_000 })).msg.toString()).toBe('layered');
      expect(wrongBlocks(mb, (r) => mark(seed + 5, perm.indexOf(r)))).toEqual([]);

      for (const h of [read, write]) a.releaseXferHandle(h);
      for (const h of [lread, lwrite]) a.releaseXferHandle(h);
    }
    expect(ids[2]).toBe(edge - 1); // the first request
    expect(ids.filter((id) => id >= edge).length).toBeGreaterThan(0);
    expect(new Set(ids).size).toBe(ids.length);
    for (const id of ids) expect(Number.isSafeInteger(id) && id > 0).toBe(true);
  });

  it('an agent whose handles run out refuses new ones with NIXL_ERR_NOT_ALLOWED; what it made still works', async () => {
    const a = agent('hnd-a', { testFirstHandle: ENGINE_LIMIT - 4 });
    const b = agent('hnd-b', {});
    const { ma, mb, local, remote } = preparedBlocks(a, b, N, BLOCK);
    const last = a.makePreppedXfer('READ', local, ALL, remote, perm);
    expect(last.id).toBe(ENGINE_LIMIT - 1);
    const out = /^NIXL_ERR_NOT_ALLOWED: .*out of handles/;
    expect(codeOf(() => a.makePreppedXfer('READ', local, ALL, remote, perm))).toMatch(out);
    expect(codeOf(() => a.makeLayeredXfer('READ', local, localLayers, remote, remoteLayers))).toMatch(out);
    expect(codeOf(() => a.prepXferDlist('NIXL_INIT_AGENT', [ma.subarray(0, BLOCK)]))).toMatch(out);
    expect(codeOf(() => a.initializeXfer('READ', [ma.subarray(0, BLOCK)], [mb.subarray(0, BLOCK)], 'hnd-b'))).toMatch(
      out,
    );
    expect(codeOf(() => a.registerMemory(allocate(BLOCK)))).toMatch(out);
    // Refused before anything was made: the request made last still moves its bytes.
    fill(mb, 7);
    a.transfer(last);
    await a.wait(last, { timeoutMs: 10_000 });
    expect(wrongBlocks(ma, (i) => mark(7, perm[i]))).toEqual([]);
    a.releaseXferHandle(last);
    expect(codeOf(() => a.makePreppedXfer('READ', local, ALL, remote, perm))).toMatch(out);
  });
});
