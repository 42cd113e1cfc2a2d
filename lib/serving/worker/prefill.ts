// The prefill role: evaluate the prompt (reading a previous turn's KV where
// it is provably this prompt's prefix), put its KV into free blocks, hold
// them for the decode (handoff: read by a pull, or written by a push), and
// answer with the kv_transfer_params that name them:
//   model.prefill -> blocks -> write the KV -> holds.add -> route.offer -> answer
import { namesPreviousTurn } from '../../kv/turn-params';
import { signKvTransferParams } from '../../kv/params-auth';
import { failure } from '../api/errors';
import { completionBody } from '../api/openai';
import { tamperEnvelope } from '../models/kv-state';
import type { PrefilledKv } from '../models/types';
import type { RoleCall, WorkerParts } from './context';
import type { KvRoute } from './handoff';
import type { Running } from './holds';
import { endAnswer } from './stream-end';
import type { Reuse } from './turns';

/** Prefills one request (its kv_transfer_params ask for do_remote_decode). */
export async function prefill(w: WorkerParts, r: RoleCall): Promise<void> {
  const me = w.holds.begin(r.requestId);
  try {
    await prefillOnce(w, r, me);
  } finally {
    w.holds.end(r.requestId, me);
  }
}

async function prefillOnce(w: WorkerParts, r: RoleCall, me: Running): Promise<void> {
  const { req, signal, span } = r;
  const kvIn = r.body.kv_transfer_params as Record<string, unknown>;
  const route = w.handoff.pick(kvIn);
  route.checkPrefill(req);
  const t0 = performance.now();
  let reuse: Reuse | undefined;
  let kv: PrefilledKv;
  // A model that evaluates from a previous turn's state (GGUF) reads it first.
  if (namesPreviousTurn(kvIn) && w.turns && w.model.wholeTurnReuse)
    ({ kv, reuse } = await w.turns.prefillFrom(kvIn, req, signal, span));
  else kv = await w.model.prefill(req, signal);
  w.stats.prefillMs += performance.now() - t0;
  const ids = await w.blocks.acquire(kv.blocks, signal);
  let id: string;
  try {
    if (namesPreviousTurn(kvIn) && !reuse) {
      // A previous turn's KV: what is provably this prompt's prefix is read, the rest computed.
      reuse = w.turns ? await w.turns.reuse(kvIn, req, ids, signal, span) : undefined;
      reuse ??= { tokens: 0, blocks: 0, skipped: 'bidirectional-off' };
    }
    id = route.holdId(kvIn);
    route.checkKv(kv);
  } catch (e) {
    w.blocks.give(ids);
    throw e;
  }
  const t1 = performance.now();
  kv.writeTo(w.blocks.view(ids), route.binding(id, ids), reuse?.blocks);
  w.stats.kvSaveMs += (kv.saveMs ?? 0) + performance.now() - t1;
  const tamper = w.hooks.tamperKv;
  if (tamper) tamperEnvelope(w.blocks.view(ids), ids.length, w.model.geometry.blockBytes, tamper, w.secret);
  const hold = w.holds.add({ id, ids, kind: 'prefill', keeper: route, requestId: r.requestId, span });
  await route.offer(hold, kv, signal);
  if (signal.aborted || me.released) {
    // Nobody will get the params, so nobody will read the blocks.
    w.holds.releaseHold(id);
    throw failure('aborted', 'the proxy went away');
  }
  w.stats.prefills++;
  const reused = Number(kv.info?.prefix_reused_tokens ?? 0);
  if (reused > 0) w.stats.prefixHits++;
  w.stats.prefixReusedTokens += reused;
  w.stats.prefillEvaluatedTokens += Number(kv.info?.tokens_evaluated ?? 0);
  answer(w, r, route, { id, ids, kv, reuse });
}

/** The prefill's answer: streamed (a client that asked to), the last chunk carries the params. */
function answer(
  w: WorkerParts,
  r: RoleCall,
  route: KvRoute,
  o: { id: string; ids: number[]; kv: PrefilledKv; reuse?: Reuse },
): void {
  const { kv, reuse } = o;
  const params = route.params({ id: o.id, ids: o.ids, tokens: kv.promptTokens });
  endAnswer(
    r.sink,
    {
      ...completionBody(r.requestId, w.model.id, r.req.chat, '', 'length', { prompt: kv.promptTokens, completion: 0 }),
      kv_transfer_params: w.secret === undefined ? params : signKvTransferParams(params, w.secret),
      // The proxy may release the hold early (POST /v1/kv/release, or RELEASE over ZeroMQ).
      nixl_node: {
        ...kv.info,
        worker: w.name,
        kv_release: true,
        ...(reuse ? { kv_reused_tokens: reuse.tokens } : {}),
        ...(reuse?.skipped ? { kv_reuse_skipped: reuse.skipped } : {}),
      },
    },
    r.body,
  );
}
