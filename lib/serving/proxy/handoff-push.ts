// Push (vLLM's NixlPushConnector behind a concurrent router, as vLLM's push
// demo proxy does it): the prefill and decode legs go out at once. The
// decode is told up front where the prefill's KV is (its engine id, side
// channel, TP and PP sizes, from the prefill worker's health answer) and the
// transfer id both legs share; it registers its blocks, the prefill WRITEs
// into them when it is done. When one leg fails the other is aborted: a
// decode that will not take the KV frees the prefill's blocks, a prefill
// that died stops the decode waiting for it. Never run again: the prefill
// may still WRITE into the first decode's blocks until its lease. vLLM's push
// has no bidirectional KV: a conversation's turns are prefilled whole.
import { randomUUID } from 'node:crypto';
import { prefillRequestParams } from '../../handshake/wire';
import {
  type HandedOff,
  type KvHandoff,
  checkLegs,
  decodeBodyOf,
  decodeMaxTokens,
  modelOf,
  prefillBodyOf,
} from './handoff';
import { hasDecodeFor, sameModel, serves } from './pairing';
import type { WorkerRef } from './pool';
import { type ProxyRequest, type StageCaller, StageFailure, type StageResult } from './stage-call';

/** A new transfer id: what pairs one request's two legs (vLLM DEMO1's "xfer-" + uuid4). */
export function newTransferId(): string {
  return `xfer-${randomUUID()}`;
}

/** What a push prefill leg is asked: keep the KV for a remote decode, offered under the transfer id. */
export function pushPrefillParams(transferId: string): Record<string, unknown> {
  return { ...prefillRequestParams(), transfer_mode: 'push', transfer_id: transferId };
}

/** What a push decode leg is told up front: the prefill's coordinates (vLLM's push params, pp_size included). */
export function pushDecodeParams(p: NonNullable<WorkerRef['push']>, transferId: string): Record<string, unknown> {
  return {
    do_remote_prefill: true,
    do_remote_decode: false,
    remote_engine_id: p.engineId,
    remote_host: p.host,
    remote_port: p.port,
    tp_size: p.tpSize,
    pp_size: p.ppSize,
    remote_request_id: transferId,
    transfer_id: transferId,
    transfer_mode: 'push',
  };
}

/** A push worker's KV coordinates from its health answer, or undefined (it does not serve push). */
export function pushCoordinates(h: Record<string, unknown> | undefined): WorkerRef['push'] {
  if (h?.kv_mode !== 'push') return undefined;
  const { kv_engine_id: engineId, kv_host: host, kv_port: port, tp_size: tpSize, pp_size: ppSize } = h;
  const int = (v: unknown, max: number) => Number.isSafeInteger(v) && (v as number) >= 1 && (v as number) <= max;
  if (typeof engineId !== 'string' || engineId.length > 256 || typeof host !== 'string' || host.length > 256)
    return undefined;
  if (!int(port, 65535) || !int(tpSize, 1024) || !int(ppSize, 64)) return undefined;
  return { engineId, host, port: port as number, tpSize: tpSize as number, ppSize: ppSize as number };
}

export class PushHandoff implements KvHandoff {
  readonly carriesTurns = false;
  readonly #calls: StageCaller;

  constructor(calls: StageCaller) {
    this.#calls = calls;
  }

  /** Both legs at once; the decode's answer, or the first leg's failure (the other leg aborted). */
  async run(r: ProxyRequest): Promise<HandedOff> {
    const transferId = newTransferId();
    const prefillBody = prefillBodyOf(r, pushPrefillParams(transferId));
    checkLegs(this.#calls.pools);
    const prefill = await this.#prefillWorker(modelOf(r.body));
    const ac = new AbortController();
    const legs = AbortSignal.any([r.signal, ac.signal]);
    let first: unknown;
    let decided = false;
    const pre = this.#calls.call(r, {
      stage: 'prefill',
      body: prefillBody,
      signal: legs,
      accept: (w) => w === prefill,
      decodeMaxTokens: decodeMaxTokens(r.body),
    });
    // A prefill that failed before the decode answered: the decode would only wait out its deadline.
    pre.catch((e) => {
      if (decided) return;
      first ??= e;
      ac.abort(e);
    });
    try {
      const dec = await this.#decode(r, prefill, transferId, legs);
      decided = true;
      return dec;
    } catch (e) {
      decided = true;
      first ??= e;
      ac.abort(e);
      // The prefill may have answered already: its hold is freed now rather than at its lease.
      const p = await pre.catch(() => undefined);
      const kvp = p?.answer.json?.kv_transfer_params as Record<string, unknown> | undefined;
      if (typeof kvp?.remote_request_id === 'string') this.#calls.release(prefill, kvp.remote_request_id);
      throw first;
    }
  }

  /** A healthy push prefill whose KV a healthy decode can load; where its KV is comes with its health answer. */
  async #prefillWorker(model: string | undefined): Promise<WorkerRef> {
    const { pools } = this.#calls;
    const accept = (w: WorkerRef) => w.push !== undefined && serves(w, model) && hasDecodeFor(w, pools.decode, model);
    let pw = pools.prefill.pick(new Set(), undefined, accept);
    if (!pw) {
      // Ask once before giving up.
      await this.#calls.learn();
      pw = pools.prefill.pick(new Set(), undefined, accept);
    }
    if (pw) return pw;
    throw new StageFailure(
      503,
      'prefill',
      undefined,
      'no healthy prefill worker serves push mode (its health answer gives kv_mode push and where its KV is)',
      'kv_mode_mismatch',
    );
  }

  #decode(r: ProxyRequest, prefill: WorkerRef, transferId: string, legs: AbortSignal): Promise<StageResult> {
    const model = modelOf(r.body);
    return this.#calls.call(r, {
      stage: 'decode',
      body: decodeBodyOf(r, pushDecodeParams(prefill.push!, transferId)),
      stream: r.body.stream === true,
      avoid: new Set([prefill]),
      accept: (w) => w.push !== undefined && serves(w, model) && sameModel(w.model, prefill.model),
      signal: legs,
    });
  }
}
