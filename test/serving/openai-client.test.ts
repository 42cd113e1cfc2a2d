// The proxy through OpenAI's official Node client (issue 37): what the
// client reads from streamed chunks (id, created, model), usage in a last
// chunk with no choices, vLLM's 404 for a model nobody serves, the list forms
// of `prompt`, /v1/models filled once startProxy resolves, a max_tokens
// that cannot fit the model's context and fields not served (JSON output,
// tools, logprobs) refused before any prefill.
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  type ServingProxy,
  startProxy,
  startWorker,
  SyntheticModel,
  type Worker,
  Worker as W,
} from '../../lib/serving';
import { MODEL_NAME } from '../../lib/serving/models/synthetic-kv';

/** The synthetic model with a bounded context, as a GGUF's: its health answer says max_model_len. */
class BoundedModel extends SyntheticModel {
  override readonly id = 'bounded/model';
  readonly contextSize = 64;
}

describe.each(['http', 'zmq'] as const)('the official OpenAI client against the proxy (%s)', (transport) => {
  let proxy: ServingProxy;
  let workers: Worker[];
  let client: OpenAI;
  beforeAll(async () => {
    workers = [await startWorker({ transport }), await startWorker({ transport })];
    workers.push(await new W({ transport }, new BoundedModel()).start());
    workers.push(await new W({ transport }, new BoundedModel()).start());
    proxy = await startProxy({
      transport,
      prefill: [workers[0].address, workers[2].address],
      decode: [workers[1].address, workers[3].address],
    });
    client = new OpenAI({ baseURL: `${proxy.url}/v1`, apiKey: 'none', maxRetries: 0 });
  });
  afterAll(async () => {
    await proxy?.close();
    for (const w of workers ?? []) await w.close();
  });

  it('/v1/models lists the served models as soon as startProxy resolves', async () => {
    const ids = (await client.models.list()).data.map((m) => m.id).sort();
    expect(ids).toEqual(['bounded/model', MODEL_NAME]);
  });

  it('streamed completions and chat: every chunk has id, created and model; usage in a last chunk, choices []', async () => {
    const chunks = [];
    for await (const c of await client.completions.create({
      model: MODEL_NAME,
      prompt: 'stream me',
      max_tokens: 4,
      stream: true,
      stream_options: { include_usage: true },
    }))
      chunks.push(c);
    for (const c of chunks) {
      expect(c.id).toBeTruthy();
      expect(c.model).toBe(MODEL_NAME);
      expect(Number.isInteger(c.created) && c.created > 1.7e9).toBe(true);
    }
    expect(new Set(chunks.map((c) => c.id)).size).toBe(1);
    const last = chunks.at(-1)!;
    expect(last.choices).toEqual([]);
    expect(last.usage).toMatchObject({ completion_tokens: 4, total_tokens: last.usage!.prompt_tokens + 4 });
    expect(chunks.slice(0, -1).every((c) => c.choices.length === 1)).toBe(true);
    expect(chunks.at(-2)!.choices[0].finish_reason).toBe('length');

    const chat = [];
    for await (const c of await client.chat.completions.create({
      model: MODEL_NAME,
      messages: [{ role: 'user', content: 'hello' }],
      max_tokens: 3,
      stream: true,
      stream_options: { include_usage: true },
    }))
      chat.push(c);
    expect(chat.every((c) => c.id && c.created && c.model === MODEL_NAME && c.object === 'chat.completion.chunk')).toBe(
      true,
    );
    expect(chat.at(-1)!.choices).toEqual([]);
    expect(chat.at(-1)!.usage?.completion_tokens).toBe(3);
    // Without include_usage: no usage chunk.
    const plain = [];
    for await (const c of await client.completions.create({
      model: MODEL_NAME,
      prompt: 'x',
      max_tokens: 2,
      stream: true,
    }))
      plain.push(c);
    expect(plain.every((c) => c.choices.length === 1)).toBe(true);
  });

  it('a model nobody serves: 404 model_not_found, as vLLM answers, before any work', async () => {
    const prefills = workers.reduce((n, w) => n + w.stats.prefills, 0);
    const e = await client.completions.create({ model: 'gpt-9', prompt: 'x', max_tokens: 2 }).catch((x) => x);
    expect(e).toBeInstanceOf(OpenAI.NotFoundError);
    expect(e.status).toBe(404);
    expect(e.code).toBe('model_not_found');
    expect(e.param).toBe('model');
    expect(e.message).toMatch(/gpt-9/);
    expect(workers.reduce((n, w) => n + w.stats.prefills, 0)).toBe(prefills);
    // The workers say the same to a client that reaches them directly.
    const r = await fetch(`${transport === 'http' ? workers[1].address : workers[0].address}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: 'gpt-9', prompt: 'x' }),
    }).catch(() => undefined);
    if (transport === 'http') expect(r?.status).toBe(404);
  });

  it('prompt as a list of one string is that prompt; several prompts or token ids are a 400 naming why', async () => {
    const one = await client.completions.create({ model: MODEL_NAME, prompt: ['listed prompt'], max_tokens: 3 });
    const plain = await client.completions.create({ model: MODEL_NAME, prompt: 'listed prompt', max_tokens: 3 });
    expect(one.choices[0].text).toBe(plain.choices[0].text);
    const two = await client.completions
      .create({ model: MODEL_NAME, prompt: ['a', 'b'], max_tokens: 3 })
      .catch((x) => x);
    expect(two).toBeInstanceOf(OpenAI.BadRequestError);
    expect(two.message).toMatch(/2 prompts: send one per request/);
    const ids = await client.completions
      .create({ model: MODEL_NAME, prompt: [1, 2, 3], max_tokens: 3 })
      .catch((x) => x);
    expect(ids).toBeInstanceOf(OpenAI.BadRequestError);
  });

  it('JSON output, tool calls or logprobs asked for: BadRequestError naming the field, before any prefill', async () => {
    const prefills = workers.reduce((n, w) => n + w.stats.prefills, 0);
    const messages = [{ role: 'user' as const, content: 'give me JSON' }];
    for (const [param, extra] of [
      ['response_format', { response_format: { type: 'json_object' as const } }],
      ['tools', { tools: [{ type: 'function' as const, function: { name: 'lookup', parameters: {} } }] }],
      ['logprobs', { logprobs: true, top_logprobs: 2 }],
    ] as const) {
      const e = await client.chat.completions
        .create({ model: MODEL_NAME, messages, max_tokens: 3, ...extra })
        .catch((x) => x);
      expect(e, param).toBeInstanceOf(OpenAI.BadRequestError);
      expect(e.param).toBe(param);
      expect(e.code).toBe('unsupported_parameter');
      expect(e.type).toBe('invalid_request_error');
    }
    const c = await client.completions
      .create({ model: MODEL_NAME, prompt: 'x', max_tokens: 2, logprobs: 1 })
      .catch((x) => x);
    expect(c.param).toBe('logprobs');
    expect(workers.reduce((n, w) => n + w.stats.prefills, 0)).toBe(prefills);
    // What asks for nothing is served.
    const ok = await client.chat.completions.create({
      model: MODEL_NAME,
      messages,
      max_tokens: 3,
      logprobs: false,
      tools: [],
      tool_choice: 'none',
      response_format: { type: 'text' },
    });
    expect(ok.choices[0].message.content).toBeTruthy();
  });

  it('a max_tokens that cannot fit the context is a 400 before any prefill', async () => {
    const prefills = workers.reduce((n, w) => n + w.stats.prefills, 0);
    const e = await client.completions.create({ model: 'bounded/model', prompt: 'x', max_tokens: 64 }).catch((x) => x);
    expect(e).toBeInstanceOf(OpenAI.BadRequestError);
    expect(e.message).toMatch(/max_tokens 64 does not fit: the model's context holds 64 tokens/);
    expect(workers.reduce((n, w) => n + w.stats.prefills, 0)).toBe(prefills);
    const ok = await client.completions.create({ model: 'bounded/model', prompt: 'x', max_tokens: 8 });
    expect(ok.model).toBe('bounded/model');
    expect((await client.models.list()).data.find((m) => m.id === 'bounded/model')).toMatchObject({
      max_model_len: 64,
    });
  });
});
