// What a prefill may reuse of a previous turn's params (lib/kv/turn-params.ts):
// only the whole blocks of tokens proven to be its prompt's prefix; and the
// first remote blocks, not the last, when a continuation reads fewer.
import { describe, expect, it } from 'vitest';
import { buildKvTransferParams } from '../../lib/handshake/wire';
import { signKvTransferParams } from '../../lib/kv/params-auth';
import { expandTail } from '../../lib/kv/limits';
import { namesPreviousTurn, planReuse, tokensDigest, turnParams } from '../../lib/kv/turn-params';

const held = Array.from({ length: 100 }, (_, i) => (i * 7) % 256);
const base = (ids = [10, 11, 12, 13, 14, 15, 16], n = held.length) =>
  buildKvTransferParams(
    {
      remoteBlockIds: [ids],
      remoteEngineId: 'D',
      remoteRequestId: 'turn-1',
      remoteHost: '127.0.0.1',
      remotePort: 5600,
      tpSize: 1,
      remoteNumTokens: n,
      remoteBlocksExpiryTime: 1000,
    },
    'v12',
  );
const rules = { tokensPerBlock: 16, wire: 'v12' as const };
const prompt = [...held, 1, 2, 3];

describe('planReuse', () => {
  it('reads the whole blocks of a proven prefix, leaving the last prompt token to compute', () => {
    const p = turnParams(base(), held);
    expect(planReuse(p, prompt, rules)).toMatchObject({ tokens: 96, blocks: 6, release: false });
    // The prompt is exactly the held tokens: the block holding its last token is computed.
    expect(planReuse(p, held, rules)).toMatchObject({ tokens: 96, blocks: 6 });
    const exact = turnParams(base(undefined, 96), held.slice(0, 96));
    expect(planReuse(exact, held.slice(0, 96), rules)).toMatchObject({ tokens: 80, blocks: 5 });
  });

  it('a whole state (GGUF): every named block is read, the tokens whole batches of the granularity', () => {
    const whole = { ...rules, tokensPerBlock: 32, wholeState: true, recomputeThreshold: 32 };
    // Two blocks hold a state of 100 tokens: no block per token is needed.
    const p = turnParams(base([10, 11]), held);
    expect(planReuse(p, prompt, whole)).toMatchObject({ tokens: 96, blocks: 2, release: false });
    expect(planReuse(p, held, whole)).toMatchObject({ tokens: 96, blocks: 2 });
    expect(planReuse(turnParams(base([]), held), prompt, whole).reason).toBe('malformed');
    // Blocks of tokens (not a whole state), the same params: a block per token is missing.
    expect(planReuse(p, prompt, rules).reason).toBe('mismatch');
  });

  it('recomputes what is not provably the prefix', () => {
    const p = turnParams(base(), held);
    const other = [...prompt];
    other[50] ^= 1;
    expect(planReuse(p, other, rules).reason).toBe('mismatch');
    expect(planReuse(p, held.slice(0, 99), rules).reason).toBe('mismatch');
    expect(planReuse({ ...p, remote_num_tokens: 1e9 }, prompt, rules).reason).toBe('mismatch');
    expect(planReuse({ ...p, nixl_node_prefix_tokens: 2 ** 60 }, prompt, rules).reason).toBe('unproven');
    expect(planReuse(turnParams(base([10, 11]), held), prompt, rules).reason).toBe('mismatch');
    expect(planReuse(base(), prompt, rules).reason).toBe('unproven');
    expect(planReuse({ ...p, remote_block_ids: 'x' }, prompt, rules).reason).toBe('malformed');
    expect(planReuse(p, prompt, { ...rules, secret: 'k' }).reason).toBe('unauthenticated');
    const signed = signKvTransferParams(p, 'k');
    expect(planReuse(signed, prompt, { ...rules, secret: 'k' }).tokens).toBe(96);
    expect(planReuse({ ...signed, nixl_node_prefix_tokens: 64 }, prompt, { ...rules, secret: 'k' }).reason).toBe(
      'unauthenticated',
    );
  });

  it('under the threshold: nothing read, the decode told to free it', () => {
    const p = turnParams(base(), held);
    expect(planReuse(p, prompt, { ...rules, recomputeThreshold: 97 })).toMatchObject({
      tokens: 0,
      reason: 'below-threshold',
      release: true,
    });
    const short = turnParams(base([10], 10), held.slice(0, 10));
    expect(planReuse(short, prompt.slice(0, 0).concat(held.slice(0, 10), [9]), rules)).toMatchObject({
      reason: 'nothing-new',
      release: true,
    });
  });

  it('digests token ids as u32 (ids past 255 differ), and says which params name a turn', () => {
    expect(tokensDigest([1, 256])).not.toBe(tokensDigest([1, 0]));
    expect(tokensDigest([])).toMatch(/^[0-9a-f]{64}$/);
    expect(namesPreviousTurn({ do_remote_decode: true, remote_block_ids: null })).toBe(false);
    expect(namesPreviousTurn({ remote_block_ids: [[]] })).toBe(false);
    expect(namesPreviousTurn({ remote_block_ids: [[3]] })).toBe(true);
    expect(namesPreviousTurn({ remote_block_ids: [3] })).toBe(true);
  });
});

describe('expandTail', () => {
  it('the last blocks by default (vLLM: a partial prefix hit), the first with head', () => {
    expect(expandTail([5, 6, 7], 2, 3, 100)).toEqual([13, 14, 15]);
    expect(expandTail([5, 6, 7], 2, 3, 100, undefined, true)).toEqual([10, 11, 12]);
  });
});
