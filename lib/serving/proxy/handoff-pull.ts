// Pull (vLLM's NixlConnector behind its disagg proxy): the prefill computes
// the prompt's KV and answers kv_transfer_params naming its blocks; the
// decode, given them, reads the blocks and generates. A decode that could
// not read them inside the prefill's lease answers kv_expired and read
// nothing it trusts; one that died or broke read nothing we answer from
// either: both are safe to run again from a fresh prefill (new blocks),
// once, on another decode where there is one (never an answer made from
// blocks that were reused).
import type { WireName } from '../../handshake/model';
import { namesPreviousTurn, parseKvTransferParams, prefillRequestParams } from '../../handshake/wire';
import type { ClaimedTurn } from './conversations';
import {
  type HandedOff,
  type KvHandoff,
  checkLegs,
  decodeBodyOf,
  decodeMaxTokens,
  modelOf,
  prefillBodyOf,
} from './handoff';
import { hasDecodeFor, modelMismatch, sameModel, serves } from './pairing';
import type { WorkerRef } from './pool';
import { type ProxyRequest, type StageCaller, StageFailure, type StageResult } from './stage-call';

export class PullHandoff implements KvHandoff {
  readonly carriesTurns = true;
  readonly #calls: StageCaller;
  readonly #wire?: WireName;
  readonly #prefillRetries: number;

  constructor(calls: StageCaller, o: { wire?: WireName; prefillRetries?: number }) {
    this.#calls = calls;
    this.#wire = o.wire;
    this.#prefillRetries = o.prefillRetries ?? 1;
  }

  /** Prefill then decode; a decode that failed in a way a fresh prefill may fix is run again, once. */
  async run(r: ProxyRequest, turn?: ClaimedTurn): Promise<HandedOff> {
    // The conversation's previous turn, held by its decode: the prefill reads what it can of it.
    const prefillBody = prefillBodyOf(r, turn?.params ?? prefillRequestParams());
    const avoid = new Set<WorkerRef>();
    try {
      return await this.#once(r, prefillBody, avoid, turn);
    } catch (e) {
      if (!(e instanceof StageFailure) || e.stage !== 'decode' || !e.rule.retry || r.signal.aborted) throw e;
      if (e.type === 'kv_expired') this.#calls.stats.expiredRetries++;
      else this.#calls.stats.decodeRetries++;
      try {
        return await this.#once(r, prefillBody, avoid, turn);
      } catch (again) {
        // Nothing left to try: the first failure says more than 'no healthy worker'.
        throw again instanceof StageFailure && again.worker === undefined ? e : again;
      }
    }
  }

  async #once(
    r: ProxyRequest,
    prefillBody: Record<string, unknown>,
    avoid: Set<WorkerRef>,
    turn?: ClaimedTurn,
  ): Promise<HandedOff> {
    let pre: StageResult;
    try {
      pre = await this.#prefill(r, prefillBody);
    } catch (e) {
      // This turn failed: nothing will read the previous turn's hold (a read that happened freed it already).
      turn?.release();
      throw e;
    }
    const kv = pre.answer.json?.kv_transfer_params as Record<string, unknown> | undefined;
    let remoteRequestId: string;
    try {
      remoteRequestId = parseKvTransferParams(kv, this.#wire).remoteRequestId;
    } catch (e) {
      const why = `prefill answered without usable kv_transfer_params: ${(e as Error).message}`;
      throw new StageFailure(502, 'prefill', pre.worker.address, why);
    }
    const info = pre.answer.json?.nixl_node as
      | { kv_release?: unknown; kv_reused_tokens?: unknown; kv_reuse_skipped?: unknown }
      | undefined;
    const reused = info?.kv_reused_tokens;
    // The previous turn's hold, not read (the prompt did not prove to be its prefix...): free it now.
    if (reused === 0) turn?.release();
    try {
      const dec = await this.#decode(r, pre.worker, decodeBodyOf(r, kv!), avoid);
      const named = namesPreviousTurn(prefillBody.kv_transfer_params as Record<string, unknown>);
      const skipped = typeof info?.kv_reuse_skipped === 'string' ? info.kv_reuse_skipped : undefined;
      return { ...dec, turn: { named, reused, skipped } };
    } catch (e) {
      // The decode will not read it (failed, or the client went away): the
      // prefill frees the blocks now instead of at the end of its lease.
      if (info?.kv_release === true) this.#calls.release(pre.worker, remoteRequestId);
      if (e instanceof StageFailure && e.worker) {
        const w = this.#calls.pools.decode.workers.find((x) => x.address === e.worker);
        if (w) avoid.add(w);
      }
      throw e;
    }
  }

  #prefill(r: ProxyRequest, body: Record<string, unknown>): Promise<StageResult> {
    const { pools } = this.#calls;
    const model = modelOf(r.body);
    checkLegs(pools);
    const mismatch = modelMismatch(pools.prefill, pools.decode, model);
    if (mismatch)
      throw new StageFailure(503, 'prefill', undefined, `${mismatch} (nothing was prefilled)`, 'model_mismatch');
    return this.#calls.call(r, {
      stage: 'prefill',
      body,
      retries: this.#prefillRetries,
      // Only a prefill whose KV a healthy decode can load.
      accept: (w) => serves(w, model) && hasDecodeFor(w, pools.decode, model),
      decodeMaxTokens: decodeMaxTokens(r.body),
    });
  }

  #decode(r: ProxyRequest, prefill: WorkerRef, body: Record<string, unknown>, avoid: Set<WorkerRef>) {
    const model = modelOf(r.body);
    return this.#calls.call(r, {
      stage: 'decode',
      body,
      stream: r.body.stream === true,
      avoid: new Set([prefill, ...avoid]),
      accept: (w) => serves(w, model) && sameModel(w.model, prefill.model),
    });
  }
}
