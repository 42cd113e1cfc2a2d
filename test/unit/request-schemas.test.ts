// Request bodies against their endpoints' JSON Schemas (docs/*-request.schema.json):
// every 400 is OpenAI's invalid_request_error naming the field at fault (param)
// and saying what it must be, on the completions, chat and vLLM generate
// bodies alike.
import { describe, expect, it } from 'vitest';
import { checkGenerateRequest } from '../../lib/serving/api/generate';
import { checkCompletionRequest } from '../../lib/serving/api/schema';

type Body = Record<string, unknown>;

function refusal(f: () => void): { status?: number; message: string; details?: Body } {
  try {
    f();
  } catch (e) {
    const h = e as { status?: number; message: string; details?: Body };
    return { status: h.status, message: h.message, details: h.details };
  }
  throw new Error('taken');
}

const completion = (b: Body, kv: 'object' | 'refuse' = 'object') =>
  refusal(() => checkCompletionRequest('/v1/completions', b, { kvTransferParams: kv }));
const chat = (b: Body) =>
  refusal(() => checkCompletionRequest('/v1/chat/completions', b, { kvTransferParams: 'object' }));
const generate = (b: Body, kv: 'object' | 'refuse' = 'object') =>
  refusal(() => checkGenerateRequest(b, { kvTransferParams: kv }));
const part = (p: unknown) => ({ messages: [{ role: 'user', content: [p] }] });
const ok = { token_ids: [104], sampling_params: {} };

describe('request bodies against their schemas: a 400 naming the field (param)', () => {
  it.each<[string, () => ReturnType<typeof refusal>, string, RegExp]>([
    ['no prompt', () => completion({}), 'prompt', /must be a string/],
    ['n 2', () => completion({ prompt: 'x', n: 2 }), 'n', /must be 1/],
    ['max_tokens 1e300', () => completion({ prompt: 'x', max_tokens: 1e300 }), 'max_tokens', /positive integer/],
    ['stop [1]', () => completion({ prompt: 'x', stop: [1] }), 'stop', /at most 16 strings/],
    ['seed as a bigint (msgpack)', () => completion({ prompt: 'x', seed: 1n }), 'seed', /integer/],
    ['temperature NaN (msgpack)', () => completion({ prompt: 'x', temperature: Number.NaN }), 'temperature', /0 to 2/],
    [
      'client kv_transfer_params',
      () => completion({ prompt: 'x', kv_transfer_params: {} }, 'refuse'),
      'kv_transfer_params',
      /set by the proxy/,
    ],
    ['messages []', () => chat({ messages: [] }), 'messages', /non-empty array/],
    ['a message not an object', () => chat({ messages: [5] }), 'messages[0]', /an object/],
    ['role ""', () => chat({ messages: [{ role: '', content: 'x' }] }), 'messages[0].role', /non-empty string/],
    ['no content', () => chat({ messages: [{ role: 'user' }] }), 'messages[0].content', /content parts/],
    ['text 5', () => chat(part({ type: 'text', text: 5 })), 'messages[0].content[0].text', /a string/],
    ['part type', () => chat(part({ type: 'audio' })), 'messages[0].content[0].type', /'text' or 'image_url'/],
    [
      'url 3',
      () => chat(part({ type: 'image_url', image_url: { url: 3 } })),
      'messages[0].content[0].image_url.url',
      /a string/,
    ],
    ['no token_ids', () => generate({ sampling_params: {} }), 'token_ids', /array of token ids/],
    ['token_ids []', () => generate({ token_ids: [], sampling_params: {} }), 'token_ids', /at least one/],
    ['token id -1', () => generate({ token_ids: [104, -1], sampling_params: {} }), 'token_ids[1]', /negative/],
    ['token id 1e300', () => generate({ token_ids: [1e300], sampling_params: {} }), 'token_ids[0]', /integer/],
    ['no sampling_params', () => generate({ token_ids: [104] }), 'sampling_params', /an object/],
    [
      'max_tokens 0',
      () => generate({ ...ok, sampling_params: { max_tokens: 0 } }),
      'sampling_params.max_tokens',
      /positive/,
    ],
    ['n 4 on a worker', () => generate({ ...ok, sampling_params: { n: 4 } }), 'sampling_params.n', /1/],
    [
      'max_tokens 5000 on a worker',
      () => generate({ ...ok, sampling_params: { max_tokens: 5000 } }),
      'sampling_params.max_tokens',
      /at most 4096/,
    ],
    [
      'extra_args "x"',
      () => generate({ ...ok, sampling_params: { extra_args: 'x' } }),
      'sampling_params.extra_args',
      /an object/,
    ],
    [
      'nested kv 7',
      () => generate({ ...ok, sampling_params: { extra_args: { kv_transfer_params: 7 } } }),
      'sampling_params.extra_args.kv_transfer_params',
      /an object/,
    ],
    [
      'client nested kv',
      () => generate({ ...ok, sampling_params: { extra_args: { kv_transfer_params: {} } } }, 'refuse'),
      'sampling_params.extra_args.kv_transfer_params',
      /set by the proxy/,
    ],
    ['stream "yes"', () => generate({ ...ok, stream: 'yes' }), 'stream', /a boolean/],
    ['features', () => generate({ ...ok, features: { mm_hashes: {} } }), 'features', /not supported/],
    ['request_id 300 chars', () => generate({ ...ok, request_id: 'r'.repeat(300) }), 'request_id', /256/],
  ])('%s', (_what, f, param, message) => {
    const r = f();
    expect(r.status).toBe(400);
    expect(r.details).toMatchObject({ param });
    expect(r.message).toContain(`'${param}'`);
    expect(r.message).toMatch(message);
  });

  it('well-formed bodies pass, null where vLLM takes it', () => {
    expect(() =>
      checkCompletionRequest('/v1/completions', { prompt: 'x', n: null, stop: null }, { kvTransferParams: 'object' }),
    ).not.toThrow();
    expect(() =>
      checkCompletionRequest('/v1/chat/completions', part({ type: 'image_url', image_url: { url: 'data:' } }), {
        kvTransferParams: 'object',
      }),
    ).not.toThrow();
    expect(() =>
      checkGenerateRequest(
        { ...ok, model: null, stream: null, sampling_params: { max_tokens: null, extra_args: null } },
        { kvTransferParams: 'refuse' },
      ),
    ).not.toThrow();
  });
});
