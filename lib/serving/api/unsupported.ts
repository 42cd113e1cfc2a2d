// Fields of OpenAI's (and vLLM's) /v1/completions and /v1/chat/completions
// bodies that nixl-node does not honour. Each is taken at the value that asks
// for nothing (logprobs: false, tools: [], tool_choice: 'none',
// response_format: {type: 'text'}, ...), so clients that always send them
// keep working; any other value is a 400 naming the field, never an answer
// that silently lacks what was asked for (JSON output, tool calls, logprobs).
// The proxy and the workers check with this one table (schema.ts).
// Fields that change nothing in the answer (user, metadata, ...) and names
// neither API defines are let through, as vLLM does.

type Body = Record<string, unknown>;

interface Rule {
  /** The values that ask for nothing (null always does). */
  harmless: (v: unknown, body: Body) => boolean;
  /** What the 400 says after "'<field>' ...". */
  why: string;
}

const is =
  (...ok: unknown[]) =>
  (v: unknown) =>
    ok.includes(v);
const emptyList = (v: unknown) => Array.isArray(v) && v.length === 0;
const emptyObject = (v: unknown) =>
  typeof v === 'object' && v !== null && !Array.isArray(v) && Object.keys(v).length === 0;
/** tool_choice / function_call: 'none', or 'auto' with no tools to choose from. */
const noToolChoice = (list: string) => (v: unknown, b: Body) =>
  v === 'none' || (v === 'auto' && (b[list] == null || emptyList(b[list])));

/** Field -> the values taken. Exported for the docs test and the table in docs/serving.md. */
export const UNSUPPORTED: Readonly<Record<string, Rule>> = {
  logprobs: { harmless: is(false), why: 'is not supported: no log probabilities are returned (send false or null)' },
  top_logprobs: { harmless: is(0), why: 'is not supported: no log probabilities are returned (send 0 or null)' },
  prompt_logprobs: { harmless: () => false, why: 'is not supported: no log probabilities are returned' },
  echo: { harmless: is(false), why: 'is not supported: the prompt is not echoed (send false)' },
  suffix: { harmless: is(''), why: 'is not supported: no insertion after a suffix' },
  best_of: { harmless: is(1), why: 'is not supported: one sequence per request (send 1)' },
  logit_bias: { harmless: emptyObject, why: 'is not supported: send {} or null' },
  frequency_penalty: { harmless: is(0), why: 'is not supported: send 0 or null' },
  presence_penalty: { harmless: is(0), why: 'is not supported: send 0 or null' },
  repetition_penalty: { harmless: is(1), why: 'is not supported: send 1 or null' },
  top_k: { harmless: is(0, -1), why: 'is not supported: send -1, 0 or null (all tokens)' },
  min_p: { harmless: is(0), why: 'is not supported: send 0 or null' },
  min_tokens: { harmless: is(0), why: 'is not supported: send 0 or null' },
  ignore_eos: { harmless: is(false), why: 'is not supported: send false or null' },
  stop_token_ids: { harmless: emptyList, why: 'is not supported (use stop): send [] or null' },
  include_stop_str_in_output: { harmless: is(false), why: 'is not supported: send false or null' },
  tools: { harmless: emptyList, why: 'is not supported: no tool calls are made (send [] or leave it out)' },
  tool_choice: { harmless: noToolChoice('tools'), why: "is not supported: no tool calls are made (send 'none')" },
  functions: { harmless: emptyList, why: 'is not supported: no function calls are made' },
  function_call: {
    harmless: noToolChoice('functions'),
    why: "is not supported: no function calls are made (send 'none')",
  },
  response_format: {
    harmless: (v) => emptyObject(v) || (isObj(v) && v.type === 'text' && Object.keys(v).length === 1),
    why: "is not supported: answers are plain text (send {type: 'text'} or leave it out)",
  },
  guided_json: { harmless: () => false, why: 'is not supported: no guided decoding' },
  guided_regex: { harmless: () => false, why: 'is not supported: no guided decoding' },
  guided_choice: { harmless: () => false, why: 'is not supported: no guided decoding' },
  guided_grammar: { harmless: () => false, why: 'is not supported: no guided decoding' },
  structured_outputs: { harmless: () => false, why: 'is not supported: no guided decoding' },
  modalities: {
    harmless: (v) => Array.isArray(v) && v.length === 1 && v[0] === 'text',
    why: "is not supported: answers are text (send ['text'])",
  },
  audio: { harmless: () => false, why: 'is not supported: answers are text' },
  reasoning_effort: { harmless: () => false, why: 'is not supported' },
  web_search_options: { harmless: () => false, why: 'is not supported: no web search' },
  chat_template: { harmless: () => false, why: "is not supported: the model's own template is used" },
  add_generation_prompt: { harmless: is(true), why: 'is not supported: send true or null' },
  continue_final_message: { harmless: is(false), why: 'is not supported: send false or null' },
  truncate_prompt_tokens: { harmless: () => false, why: 'is not supported: prompts are never truncated' },
  store: { harmless: is(false), why: 'is not supported: nothing is stored (send false)' },
  // vLLM keeps a salted request's prefix cache apart from other tenants'; here every request shares one cache.
  cache_salt: {
    harmless: () => false,
    why: 'is not supported: the prefix cache is shared by every request (no per-tenant salt); leave it out',
  },
};

function isObj(v: unknown): v is Body {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/** The first field of `b` that asks for what is not served, and why; undefined when none does. */
export function unsupportedField(b: Body): { param: string; message: string } | undefined {
  for (const [param, rule] of Object.entries(UNSUPPORTED)) {
    const v = b[param];
    if (v === undefined || v === null || rule.harmless(v, b)) continue;
    return { param, message: `'${param}' ${rule.why}` };
  }
  return undefined;
}
