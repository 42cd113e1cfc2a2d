// The proxy's push mode (vLLM's NixlPushConnector behind a concurrent router,
// as vLLM's push demo proxy does it): the prefill and decode legs go out at
// once. The decode is told up front where the prefill's KV is (its engine id,
// side channel, TP and PP sizes, from the prefill worker's health answer) and
// the transfer id both legs share; it registers its blocks, the prefill
// WRITEs into them when it is done. When one leg fails the other is aborted:
// a decode that will not take the KV frees the prefill's blocks, a prefill
// that died stops the decode waiting for it.
import { randomUUID } from 'node:crypto';
import { prefillRequestParams } from '../../handshake/wire';
import { GENERATE_PATH, generateDecodeBody } from '../api/generate';
import { hasDecodeFor, sameModel, serves } from './pairing';
import type { Stage, WorkerPool, WorkerRef } from './pool';
import type { StageAnswer } from './transports';

type StageResult = { answer: StageAnswer; worker: WorkerRef; release(): void };

/** The proxy's stage call (ServingProxy's #stage). */
export type StageCall = (
  stage: Stage,
  path: string,
  body: Record<string, unknown>,
  requestId: string,
  signal: AbortSignal,
  stream: boolean,
  retries: number,
  avoid: ReadonlySet<WorkerRef>,
  o: { accept?: (w: WorkerRef) => boolean; decodeMaxTokens?: number },
) => Promise<StageResult>;

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

export interface PushDispatch {
  path: string;
  body: Record<string, unknown>;
  prefillBody: Record<string, unknown>;
  requestId: string;
  signal: AbortSignal;
  transferId: string;
  pools: Record<Stage, WorkerPool>;
  stage: StageCall;
  /** Frees a prefill's hold (the decode will not take it). */
  release(w: WorkerRef, remoteRequestId: string): void;
  /** One round of health checks that only learns what the workers say of themselves. */
  learn(): Promise<void>;
  /** The proxy's stage failure. */
  fail(status: number, stage: Stage, worker: string | undefined, message: string, type?: string): Error;
}

/** Both legs at once; the decode's answer, or the first leg's failure (the other leg aborted). */
export async function pushPrefillAndDecode(o: PushDispatch): Promise<StageResult> {
  const { pools, body, path } = o;
  if (!pools.prefill.anyHealthy) throw o.fail(503, 'prefill', undefined, 'no healthy prefill worker');
  if (!pools.decode.anyHealthy)
    throw o.fail(503, 'decode', undefined, 'no healthy decode worker (nothing was prefilled)');
  const model = typeof body.model === 'string' ? body.model : undefined;
  const accept = (w: WorkerRef) => w.push !== undefined && serves(w, model) && hasDecodeFor(w, pools.decode, model);
  let pw = pools.prefill.pick(new Set(), undefined, accept);
  if (!pw) {
    // Where a prefill's KV is comes with its health answer: ask once before giving up.
    await o.learn();
    pw = pools.prefill.pick(new Set(), undefined, accept);
  }
  if (!pw)
    throw o.fail(
      503,
      'prefill',
      undefined,
      'no healthy prefill worker serves push mode (its health answer gives kv_mode push and where its KV is)',
      'kv_mode_mismatch',
    );
  const kv = pushDecodeParams(pw.push!, o.transferId);
  const prefill = pw;
  const decodeBody = path === GENERATE_PATH ? generateDecodeBody(body, kv) : { ...body, kv_transfer_params: kv };
  const max =
    body.max_tokens ??
    body.max_completion_tokens ??
    (body.sampling_params as Record<string, unknown> | undefined)?.max_tokens;
  const ac = new AbortController();
  const legs = AbortSignal.any([o.signal, ac.signal]);
  let first: unknown;
  let decided = false;
  const pre = o.stage('prefill', path, o.prefillBody, o.requestId, legs, false, 0, new Set(), {
    accept: (w) => w === prefill,
    decodeMaxTokens: typeof max === 'number' ? max : undefined,
  });
  // A prefill that failed before the decode answered: the decode would only wait out its deadline.
  pre.catch((e) => {
    if (decided) return;
    first ??= e;
    ac.abort(e);
  });
  try {
    const dec = await o.stage(
      'decode',
      path,
      decodeBody,
      o.requestId,
      legs,
      body.stream === true,
      0,
      new Set([prefill]),
      {
        accept: (w) => w.push !== undefined && serves(w, model) && sameModel(w.model, prefill.model),
      },
    );
    decided = true;
    return dec;
  } catch (e) {
    decided = true;
    first ??= e;
    ac.abort(e);
    // The prefill may have answered already: its hold is freed now rather than at its lease.
    const p = await pre.catch(() => undefined);
    const kvp = p?.answer.json?.kv_transfer_params as Record<string, unknown> | undefined;
    if (typeof kvp?.remote_request_id === 'string') o.release(prefill, kvp.remote_request_id);
    throw first;
  }
}
