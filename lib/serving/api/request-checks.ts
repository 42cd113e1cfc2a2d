// What a front checks of a request's body before serving it, by the route
// table: the route's JSON Schema (docs/<name>.schema.json), then what a
// schema cannot say, which differs between the proxy (clients may not send
// kv_transfer_params) and a worker (the fields it does not honour). One
// place for the proxy and the workers (HTTP and ZeroMQ fronts alike).
import { type BodySchemaName, checkBody } from './body-schemas';

export { compileBodySchemas } from './body-schemas';
import { checkGenerateRequest } from './generate';
import { normalizePrompt } from './openai';
import type { RouteTable } from './routes';
import { checkCompletionRequest } from './schema';

/** The proxy, taking a client's request; or a worker, taking the proxy's. */
export type Side = 'proxy' | 'worker';

type Body = Record<string, unknown>;

const CHECKS: Record<BodySchemaName, (body: Body, side: Side) => void> = {
  'completions-request': (b, side) => {
    // A list of one prompt is that prompt (the schema then sees a string).
    normalizePrompt(b);
    checkCompletionRequest('/v1/completions', b, { kvTransferParams: side === 'proxy' ? 'refuse' : 'object' });
  },
  'chat-completions-request': (b, side) =>
    checkCompletionRequest('/v1/chat/completions', b, { kvTransferParams: side === 'proxy' ? 'refuse' : 'object' }),
  'generate-request': (b, side) =>
    checkGenerateRequest(b, { kvTransferParams: side === 'proxy' ? 'refuse' : 'object' }),
  'kv-release-request': (b) => checkBody('kv-release-request', b),
  // What else they need (one of prompt and messages, ids below the vocabulary) tokenize.ts checks.
  'tokenize-request': (b) => checkBody('tokenize-request', b),
  'detokenize-request': (b) => checkBody('detokenize-request', b),
};

/**
 * Throws a 400 naming the first field of `body` that `path`'s route refuses
 * (RequestError; normalizePrompt's HttpError for a list of prompts).
 */
export function checkRequestBody(routes: RouteTable, path: string, body: Body, side: Side): void {
  const schema = routes.get(path)?.body;
  if (schema === undefined) throw new Error(`no body is taken on ${path}`);
  CHECKS[schema](body, side);
}
