// The request bodies of /v1/completions and /v1/chat/completions, checked
// once for the proxy and the workers: a client's mistake is a 400 naming the
// field wherever it lands, never a TypeError inside a worker (a 5xx, which the
// proxy reads as the worker being sick and takes it out of the pool). The
// 400 says which field (OpenAI's `param`). The shapes are the JSON Schemas in
// docs/ (body-schemas.ts); what a schema cannot say (who may send
// kv_transfer_params, the fields not served) is checked here.
import { RequestError, checkBody } from './body-schemas';
import { unsupportedField } from './unsupported';

export { RequestError };

export interface CheckOptions {
  /** Workers take kv_transfer_params (from the proxy); the proxy refuses them from clients. */
  kvTransferParams: 'refuse' | 'object';
}

/** Throws RequestError (400) naming the first field that is wrong. */
export function checkCompletionRequest(path: string, b: Record<string, unknown>, o: CheckOptions): void {
  if (o.kvTransferParams === 'refuse' && b.kv_transfer_params !== undefined)
    throw new RequestError(400, "'kv_transfer_params' is set by the proxy, not by clients", 'kv_transfer_params');
  checkBody(path === '/v1/chat/completions' ? 'chat-completions-request' : 'completions-request', b);
  const u = unsupportedField(b);
  if (u) throw new RequestError(400, u.message, u.param, 'unsupported_parameter');
}
