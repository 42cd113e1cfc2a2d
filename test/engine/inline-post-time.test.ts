// A transfer larger than inlinePostMaxBytes, posted on the calling thread when
// its previous post took at most inlinePostMaxUs (AgentOptions): what holds
// the event loop is a post's time, not its size. Its first post, not yet
// timed, goes through the engine's thread when no post to its remote agent
// was timed either (inline-post-rate.test.ts: when one was); every post of it
// is timed again.
// Bytes are checked after every posting, inline or not.
// NIXL_NODE_ENGINE=nixl|loopback runs just that one.
import { expect, it } from 'vitest';
import { type AgentOptions, type NixlAgent, allocate } from '../../lib';
import { checkPattern, eachEngine, engineAgent, pattern } from '../helpers';

const SMALL = 64 << 10; // inlinePostMaxBytes in these tests
const SIZE = 1 << 20; // the request: over it
/** A fresh turn of the event loop: its inline budget is whole again. */
const freshTurn = () => new Promise<void>((r) => setImmediate(r));

eachEngine('inline posts by time (inlinePostMaxUs): %s engine', (engine, open) => {
  const agent = (name: string, extra: AgentOptions = {}): NixlAgent => engineAgent(engine, open, name, extra);

  /** a reads b's SIZE bytes of pattern 5 (and writes its own pattern 9 there). */
  function pair(extra: AgentOptions) {
    const a = agent(`tim-a-${engine}`, { inlinePostMaxBytes: SMALL, ...extra });
    const b = agent(`tim-b-${engine}`);
    const local = allocate(SIZE);
    const remote = allocate(SIZE);
    a.registerMemory(local);
    b.registerMemory(remote);
    a.addRemoteAgent(b.getAgentMetadata());
    b.addRemoteAgent(a.getAgentMetadata());
    return { a, local, remote, peer: b.name };
  }

  /** Posts h in a fresh turn after `before`; its state from transfer(), then waits and checks. */
  async function post(a: NixlAgent, h: ReturnType<NixlAgent['initializeXfer']>, before: () => void) {
    before();
    await freshTurn();
    const state = a.transfer(h);
    await a.wait(h, { timeoutMs: 10_000 });
    return state;
  }

  /** Three posts of h, each PROC from transfer() (the engine's thread), each moving pattern 5 into local. */
  async function threeThroughTheEngineThread(a: NixlAgent, h: ReturnType<NixlAgent['initializeXfer']>, local: Buffer) {
    for (let i = 0; i < 3; i++) {
      expect(await post(a, h, () => local.fill(0))).toBe('PROC');
      expect(checkPattern(local, 5)).toBe(true);
    }
  }

  it('its first post goes through the engine thread; once timed under the limit, the next posts are inline and DONE', async () => {
    const { a, local, remote, peer } = pair({ inlinePostMaxUs: 10_000_000 });
    pattern(remote, 5);
    const h = a.initializeXfer('READ', local, remote, peer);
    expect(await post(a, h, () => local.fill(0))).toBe('PROC');
    expect(checkPattern(local, 5)).toBe(true);
    for (let i = 0; i < 3; i++) {
      local.fill(0);
      await freshTurn();
      // UCX's cma and the loopback engine finish a one-host READ inside the post.
      expect(a.transfer(h)).toBe('DONE');
      expect(checkPattern(local, 5)).toBe(true);
      await a.wait(h);
    }
    a.releaseXferHandle(h);
  });

  it('a request whose post took longer than inlinePostMaxUs stays on the engine thread', async () => {
    // No copy of 1 MiB takes a microsecond or less.
    const { a, local, remote, peer } = pair({ inlinePostMaxUs: 1 });
    pattern(remote, 5);
    const h = a.initializeXfer('READ', local, remote, peer);
    await threeThroughTheEngineThread(a, h, local);
    a.releaseXferHandle(h);
  });

  it('inlinePostMaxUs: 0 keeps to the size rule; inlinePostMaxBytes: 0 still posts everything through the engine thread', async () => {
    for (const extra of [{ inlinePostMaxUs: 0 }, { inlinePostMaxBytes: 0, inlinePostMaxUs: 10_000_000 }]) {
      const { a, local, remote, peer } = pair(extra);
      pattern(remote, 5);
      const h = a.initializeXfer('READ', local, remote, peer);
      await threeThroughTheEngineThread(a, h, local);
      a.releaseXferHandle(h);
      for (const x of open.splice(0)) x.close();
    }
  });

  it('a bad inlinePostMaxUs is refused with NIXL_ERR_INVALID_PARAM', () => {
    for (const bad of [-1, 1.5, 2 ** 32, Number.NaN])
      expect(() => agent(`tim-bad-${engine}`, { inlinePostMaxUs: bad })).toThrow(
        expect.objectContaining({ code: 'NIXL_ERR_INVALID_PARAM' }),
      );
  });
});
