// What one request is to this worker, from its body, and the role that
// serves it (vLLM's disaggregated prefill/decode, read from kv_transfer_params):
//
//   role             when                                         serves it
//   encode           images, no kv_transfer_params                answers the count of images (an encoder's cache)
//   prefill          kv_transfer_params.do_remote_decode          prefill.ts: evaluate, hold the KV, answer params
//   decode-in-place  kv_transfer_params name this worker           decode.ts decodeInPlace: its own held blocks
//   aggregated       no kv_transfer_params                        model.generate here
//   decode           kv_transfer_params name another prefill      decode.ts decode: the KV mode's plan (pull or push)
//
// Pull or push is not a role: the KV mode (handoff.ts), picked at start,
// says how a prefill hands its KV over and how a decode gets it.
import { countImages } from '../api/http';
import { ModelNotFound } from '../api/openai';
import { checkRequestBody } from '../api/request-checks';
import { WORKER_ROUTES } from '../api/routes';
import { HttpError } from '../api/http';
import type { SpanLike } from '../../tracing';
import { Answer, generationRequest } from './answer';
import type { RoleCall, WorkerParts } from './context';
import { decode, decodeInPlace } from './decode';
import type { WorkerRequest } from './fronts/front';
import { prefill } from './prefill';

export type Role = 'encode' | 'prefill' | 'decode-in-place' | 'aggregated' | 'decode';

/** The role of a request with this body and kv_transfer_params, on the worker named `name`. */
export function classify(body: Record<string, unknown>, kvp: Record<string, unknown> | undefined, name: string): Role {
  if (countImages(body) > 0 && kvp === undefined) return 'encode';
  if (kvp?.do_remote_decode === true) return 'prefill';
  if (kvp !== undefined && kvp.remote_engine_id === name) return 'decode-in-place';
  if (kvp === undefined) return 'aggregated';
  return 'decode';
}

/** Checks a request, then serves it in its role. Throws HttpError (or what its role threw). */
export async function serve(w: WorkerParts, q: WorkerRequest, span: SpanLike): Promise<void> {
  const arrivedMs = performance.now();
  const { path, body, requestId, signal, sink } = q;
  if (path !== '/v1/completions' && path !== '/v1/chat/completions') throw new HttpError(404, `no route ${path}`);
  checkRequestBody(WORKER_ROUTES, path, body, 'worker');
  if (typeof body.model === 'string' && !w.servedModelNames.includes(body.model))
    throw new ModelNotFound(body.model, w.servedModelNames);
  // The name asked for, when it is one of ours (as vLLM answers).
  const modelName = typeof body.model === 'string' ? body.model : w.modelId;
  const req = generationRequest(path, body);
  // A decode's model makes the answered turn's KV as it decodes (GGUF), for TurnKv.keep.
  if (w.turns) req.keepTurn = true;
  const reserve = Number(q.hints?.decodeMaxTokens);
  if (Number.isSafeInteger(reserve) && reserve > 0) req.decodeMaxTokens = reserve;
  const kvp = body.kv_transfer_params as Record<string, unknown> | undefined;
  const role = classify(body, kvp, w.name);
  if (role === 'encode') {
    span.setAttribute('nixl_node.role', role);
    w.stats.encodes++;
    sink.end(200, { id: requestId, object: 'encode', model: modelName, mm_items: countImages(body) });
    return;
  }
  const known = w.model.blocksFor(req);
  if (known !== undefined) w.blocks.fits(known);
  span.setAttribute('nixl_node.role', role);
  const answer = new Answer(requestId, modelName, req.chat, body, sink);
  const r: RoleCall = { req, body, requestId, signal, sink, span, answer, arrivedMs, known };
  if (role === 'prefill') return prefill(w, r);
  if (role === 'decode-in-place') return decodeInPlace(w, r, kvp!);
  if (role === 'decode') return decode(w, r, kvp!);
  const g = await w.model.generate(req, answer.text, signal);
  w.stats.aggregated++;
  answer.finish(g, { worker: w.name, kv_blocks: 0, kv_moved: false, ...g.info });
}
