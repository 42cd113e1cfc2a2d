// The decode role: the KV a prefill made comes into this worker's blocks
// (the KV mode's plan: kv_transfer_params parsed and checked once, then
// pulled, or written by the prefill), the model generates from it, and with
// bidirectional KV the answered turn is held for the next turn's prefill.
// A decode in place reads a prefill's hold on this same worker.
import { failure } from '../api/errors';
import { type Generated, type KvBinding, KvRejected } from '../models/types';
import type { RoleCall, WorkerParts } from './context';
import { bindingOf } from './handoff';
import type { HeldTurn } from './turns';

/** Decode: the KV comes from the prefill named in kv_transfer_params. */
export async function decode(w: WorkerParts, r: RoleCall, kvp: Record<string, unknown>): Promise<void> {
  const plan = w.handoff.pick(kvp).plan(kvp, r.req, r.known);
  const taken = await w.blocks.acquireTaken(plan.blocks, r.signal);
  try {
    const f = await plan.fetch(taken, { signal: r.signal, span: r.span, arrivedMs: r.arrivedMs });
    w.stats.kvPullMs += f.ms;
    const g = await generateFrom(w, r, taken.ids, taken.give, f.binding);
    w.stats.decodes++;
    const { layers, blockBytes } = w.model.geometry;
    // Bidirectional KV: this turn's KV stays here for the next turn's prefill.
    taken.give();
    const next = heldTurn(w, r, g);
    const kvBytes = plan.blocks * layers * blockBytes;
    const moved = {
      worker: w.name,
      kv_blocks: plan.blocks,
      kv_moved: true,
      kv_mode: f.info.kv_mode,
      kv_bytes: kvBytes,
    };
    r.answer.finish(g, { ...moved, ...f.info, ...g.info }, next);
  } finally {
    taken.give();
  }
}

/** Prefilled here (one worker in both pools): the KV is in this worker's own blocks; read it in place. */
export async function decodeInPlace(w: WorkerParts, r: RoleCall, kvp: Record<string, unknown>): Promise<void> {
  const p = w.handoff.pull.parse(kvp);
  const held = w.holds.blocksOf(p.remoteRequestId, 'prefill');
  // Only blocks this worker holds for exactly that request (anything else is forged or expired).
  if (!held || held.join() !== p.remoteBlockIds[0]?.join())
    throw failure(
      'invalid_request_error',
      `request '${p.remoteRequestId}' holds no such blocks here (expired, or not prefilled here)`,
    );
  try {
    const g = await generateFrom(w, r, held, () => {}, bindingOf(p));
    w.stats.decodes++;
    const next = heldTurn(w, r, g);
    r.answer.finish(g, { worker: w.name, kv_blocks: held.length, kv_moved: false, kv_mode: 'pull', ...g.info }, next);
  } finally {
    w.holds.consumed(p.remoteRequestId);
  }
}

/** The turn this decode holds for the next one (bidirectional KV), unless its client left. */
function heldTurn(w: WorkerParts, r: RoleCall, g: Generated): HeldTurn | undefined {
  if (r.signal.aborted) return undefined;
  return w.turns?.keep(r.req, r.answer.whole, g.turn, { requestId: r.requestId, signal: r.signal });
}

/**
 * Generates from the KV in blocks ids, made for the request `binding` names;
 * a KV the model rejects is a typed 502 (its reason and NixlError code in
 * the error), nothing loaded.
 */
async function generateFrom(
  w: WorkerParts,
  r: RoleCall,
  ids: readonly number[],
  blocksRead: () => void,
  binding: KvBinding,
): Promise<Generated> {
  const { req, answer, signal } = r;
  try {
    const g = await w.model.decode(
      req,
      { view: w.blocks.view(ids), blocks: ids.length, binding, blocksRead },
      answer.text,
      signal,
    );
    w.stats.verifiedBytes += Number(g.info.verified_bytes ?? 0);
    w.stats.kvLoadMs += Number(g.info.kv_load_ms ?? 0);
    return g;
  } catch (e) {
    if (!(e instanceof KvRejected)) throw e;
    w.stats.rejectedKv++;
    w.stats.badBytes += e.badBytes;
    if (e.reason === 'mismatch') throw failure('kv_mismatch', e.message);
    throw failure('kv_rejected', `KV state rejected (${e.reason}): ${e.message}`, {
      reason: e.reason,
      nixl_code: e.code,
    });
  }
}
