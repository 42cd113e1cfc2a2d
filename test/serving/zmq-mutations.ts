// Mutated ZeroMQ serving messages for the attack tests (zmq-attack,
// llama-attack): well-formed requests of each tag, then changed as an
// attacker would (a field replaced by anything, the tag, flipped or cut
// bytes, extra or missing frames, a body that is not a map, raw bytes).
import fc from 'fast-check';
import { Packr } from 'msgpackr';
import { TAGS, unpackMap } from '../../lib/serving/api/zmq-protocol';

const packr = new Packr({ useRecords: false, mapsAsObjects: true, variableMapSize: true });

export type Msg = { frames: Buffer[]; label: string };

/** A well-formed request of each kind, msg_id i. */
const request = fc.record({
  tag: fc.constantFrom('GENERATION', 'GENERATION', 'ENCODE', 'HEALTH', 'ABORT', 'RELEASE'),
  path: fc.constantFrom('/v1/completions', '/v1/chat/completions', '/inference/v1/generate', '/nope', undefined),
  prompt: fc.string({ maxLength: 40 }),
  maxTokens: fc.integer({ min: 1, max: 3 }),
  prefill: fc.boolean(),
});

/** What an attacker does to a well-formed message. */
const mutation = fc.oneof(
  fc.constant({ kind: 'none' as const }),
  fc.record({
    kind: fc.constant('field' as const),
    key: fc.constantFrom(
      'msg_id',
      'reply_to',
      'path',
      'request_id',
      'payload',
      'traceparent',
      'remote_request_id',
      'decode_max_tokens',
      '__proto__',
      'constructor',
    ),
    value: fc.oneof(fc.anything({ maxDepth: 3 }), fc.constant(undefined), fc.string({ maxLength: 600 })),
  }),
  fc.record({
    kind: fc.constant('payload' as const),
    key: fc.constantFrom(
      'prompt',
      'messages',
      'max_tokens',
      'stream',
      'kv_transfer_params',
      'temperature',
      'prompt_token_ids',
      'model',
      'n',
      'toString',
    ),
    value: fc.anything({ maxDepth: 3 }),
  }),
  fc.record({
    kind: fc.constant('tag' as const),
    tag: fc.oneof(fc.string({ maxLength: 30 }), fc.constantFrom(...TAGS)),
  }),
  fc.record({
    kind: fc.constant('bytes' as const),
    flips: fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { minLength: 1, maxLength: 4 }),
  }),
  fc.record({ kind: fc.constant('truncate' as const), at: fc.nat() }),
  fc.record({
    kind: fc.constant('frames' as const),
    extra: fc.array(fc.uint8Array({ maxLength: 64 }), { maxLength: 3 }),
  }),
  fc.record({ kind: fc.constant('body' as const), value: fc.anything({ maxDepth: 4 }) }),
  fc.record({ kind: fc.constant('raw' as const), bytes: fc.uint8Array({ maxLength: 200 }) }),
);

function build(
  i: number,
  r: fc.RecordValue<typeof request>,
  m: typeof mutation extends fc.Arbitrary<infer T> ? T : never,
  replyTo: string,
): Msg {
  const payload: Record<string, unknown> =
    r.path === '/v1/chat/completions'
      ? { messages: [{ role: 'user', content: r.prompt }], max_tokens: r.maxTokens }
      : r.path === '/inference/v1/generate'
        ? { token_ids: [...r.prompt].map((c) => c.charCodeAt(0) % 200), sampling_params: { max_tokens: r.maxTokens } }
        : { prompt: r.prompt, max_tokens: r.maxTokens };
  if (r.prefill) payload.kv_transfer_params = { do_remote_decode: true };
  let tag: string = r.tag;
  let body: Record<string, unknown> = {
    msg_id: `m${i}`,
    request_id: `r${i}`,
    reply_to: replyTo,
    ...(r.path ? { path: r.path } : {}),
    payload,
  };
  if (r.tag === 'HEALTH') body = { msg_id: `m${i}`, reply_to: replyTo };
  if (r.tag === 'ABORT') body = { msg_id: `m${i - 1}` };
  if (r.tag === 'RELEASE') body = { msg_id: `m${i}`, request_id: `r${i - 1}` };
  if (m.kind === 'field') {
    if (m.value === undefined) delete body[m.key];
    else Object.defineProperty(body, m.key, { value: m.value, enumerable: true, configurable: true, writable: true });
  }
  if (m.kind === 'payload')
    Object.defineProperty(payload, m.key, { value: m.value, enumerable: true, configurable: true, writable: true });
  if (m.kind === 'tag') tag = m.tag;
  let packed: Buffer;
  try {
    packed = packr.pack(m.kind === 'body' ? m.value : body);
  } catch {
    packed = packr.pack(body);
  }
  if (m.kind === 'bytes') {
    packed = Buffer.from(packed);
    for (const [at, v] of m.flips) packed[at % packed.length] = v;
  }
  if (m.kind === 'truncate') packed = packed.subarray(0, m.at % packed.length);
  if (m.kind === 'raw') packed = Buffer.from(m.bytes);
  let frames = [Buffer.from(tag, 'latin1'), packed];
  if (m.kind === 'frames')
    frames = m.extra.length === 1 ? [packed] : [...frames, ...m.extra.map((e) => Buffer.from(e))];
  return { frames, label: `${i} ${r.tag} ${JSON.stringify(m).slice(0, 200)}` };
}

export function messages(n: number, seed: number, replyTo: string): Msg[] {
  const pairs = fc.sample(fc.tuple(request, mutation), { seed, numRuns: n });
  return pairs.map(([r, m], i) => build(i, r, m, replyTo));
}

/** How many of them are ABORT or RELEASE with a usable msg_id: never answered. */
export function silentCount(all: Msg[]): number {
  return all.filter((m) => {
    const body = m.frames.length === 2 ? unpackMap(m.frames[1]) : undefined;
    const tag = m.frames[0].toString('latin1');
    const id = body?.msg_id;
    return (tag === 'ABORT' || tag === 'RELEASE') && typeof id === 'string' && id.length > 0 && id.length <= 256;
  }).length;
}
