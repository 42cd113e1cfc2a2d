// One publisher's stream as the consumer must follow it (spec §7, §10):
// replay on connect, a gap replayed from last+1 with live messages held back
// until the replay is applied, a sequence going backwards clears the worker,
// duplicates skipped, and a replay that cannot cover a gap is a counted loss.
import { describe, expect, it } from 'vitest';
import { EventStream, MAX_HELD, type StreamSink } from '../../lib/serving/kv-index/stream';

function harness(hasReplay = true) {
  const log: string[] = [];
  const counts: Record<string, number> = {};
  const replays: bigint[] = [];
  const sink: StreamSink = {
    apply: (seq) => log.push(`apply ${seq}`),
    clear: () => log.push('clear'),
    replay: (start) => {
      if (hasReplay) replays.push(start);
      return hasReplay;
    },
    count: (w) => {
      counts[w] = (counts[w] ?? 0) + 1;
    },
  };
  const p = new Uint8Array([1]);
  return { s: new EventStream(sink), log, counts, replays, p };
}

describe('KV event stream state machine', () => {
  it('replays from 0 on connect, holding live messages back until the replay is applied', () => {
    const { s, log, replays, p } = harness();
    s.connected();
    expect(replays).toEqual([0n]);
    s.live(3n, p);
    s.live(4n, p);
    expect(log).toEqual([]); // held
    s.replayed(0n, p);
    s.replayed(1n, p);
    s.replayed(2n, p);
    s.replayed(3n, p);
    s.replayEnded();
    expect(log).toEqual(['apply 0', 'apply 1', 'apply 2', 'apply 3', 'apply 4']);
    expect(s.last).toBe(4n);
  });

  it('a gap asks for a replay from last+1; later live messages wait, duplicates are skipped', () => {
    const { s, log, counts, replays, p } = harness();
    s.connected();
    s.replayEnded();
    s.live(0n, p);
    s.live(1n, p);
    s.live(4n, p); // 2 and 3 lost on the live path
    s.live(5n, p);
    expect(replays).toEqual([0n, 2n]);
    expect(log).toEqual(['apply 0', 'apply 1']);
    s.replayed(2n, p);
    s.replayed(3n, p);
    s.replayed(4n, p);
    s.replayEnded();
    expect(log).toEqual(['apply 0', 'apply 1', 'apply 2', 'apply 3', 'apply 4', 'apply 5']);
    s.live(5n, p);
    expect(counts).toMatchObject({ gaps: 1, replays: 2, duplicates: 2 });
    expect(counts.replay_lost).toBeUndefined();
  });

  it('a sequence that goes backwards is a restart: the worker is cleared and followed from its new 0', () => {
    const { s, log, counts, p } = harness();
    s.connected();
    s.replayEnded();
    for (const n of [0n, 1n, 2n]) s.live(n, p);
    s.live(0n, p);
    expect(log).toEqual(['apply 0', 'apply 1', 'apply 2', 'clear', 'apply 0']);
    expect(counts.restarts).toBe(1);
    expect(s.last).toBe(0n);
  });

  it('a restart seen mid-stream (seq > 0, below last) replays the new incarnation from 0', () => {
    const { s, log, replays, p } = harness();
    s.connected();
    s.replayEnded();
    for (const n of [0n, 1n, 2n, 3n, 4n]) s.live(n, p);
    s.live(2n, p);
    expect(replays).toEqual([0n, 0n]);
    s.replayed(0n, p);
    s.replayed(1n, p);
    s.replayEnded();
    expect(log.slice(5)).toEqual(['clear', 'apply 0', 'apply 1', 'apply 2']);
  });

  it('a replay that no longer covers the gap: counted, the worker cleared, rebuilt from the first batch left', () => {
    const { s, log, counts, p } = harness();
    s.connected();
    s.replayed(7n, p); // the buffer starts at 7: 0..6 are gone
    s.replayed(8n, p);
    s.replayEnded();
    expect(log).toEqual(['clear', 'apply 7', 'apply 8']);
    expect(counts.replay_lost).toBe(1);
    // Live messages go on from there: nothing is dropped for ever after.
    s.live(9n, p);
    expect(log.at(-1)).toBe('apply 9');
  });

  it('an empty replay while live messages wait past a gap: counted loss, then the held ones in order', () => {
    const { s, log, counts, p } = harness();
    s.connected();
    s.replayEnded();
    s.live(0n, p);
    s.live(5n, p);
    s.live(6n, p);
    s.replayEnded(); // the publisher had nothing from 1
    expect(log).toEqual(['apply 0', 'clear', 'apply 5', 'apply 6']);
    expect(counts.replay_lost).toBe(1);
  });

  it('without a replay endpoint, a gap is a counted loss at once', () => {
    const { s, log, counts, p } = harness(false);
    s.connected();
    s.live(3n, p);
    s.live(4n, p);
    s.live(6n, p);
    expect(log).toEqual(['clear', 'apply 3', 'apply 4', 'clear', 'apply 6']);
    expect(counts).toMatchObject({ gaps: 2, replay_lost: 2 });
  });

  it('holds at most MAX_HELD live messages during a replay; the rest are counted and the gap handled at its end', () => {
    const { s, log, counts, p } = harness();
    s.connected();
    for (let i = 0; i < MAX_HELD + 10; i++) s.live(BigInt(i), p);
    expect(counts.held_overflow).toBe(10);
    s.replayEnded();
    expect(log.length).toBe(MAX_HELD);
    s.live(BigInt(MAX_HELD + 10), p);
    expect(counts.gaps).toBe(1);
  });
});
