// Layered transfer requests: the layer-wise KV transfer (vLLM's
// save_kv_layer, LMCache's and Mooncake's layer-wise senders) as one request
// whose layers are posted one by one as each is ready, completing once.
// NixlAgent.makeLayeredXfer and NixlAgent.postLayer are the entry points; the
// addon holds the state (native/addon/layered.h), so a layer costs one native
// call: no request made, no promise, no allocation per layer.
import { toIndices } from '../descriptors';
import { invalidParam } from '../errors';
import type { NativeAgent } from '../native';
import type { DlistHandle, NotifMsg, XferOp } from './types';

/**
 * A layered transfer request (NixlAgent.makeLayeredXfer): one request whose
 * layers are posted one at a time with NixlAgent.postLayer, as each layer of
 * the KV cache is ready, and which completes once, when every layer is done.
 *
 * It is a transfer handle like any other for `wait`, `checkXferState`,
 * `getXferError` and `releaseXferHandle`; `transfer` posts every layer not yet
 * posted in the current posting at once.
 */
export class LayeredXferHandle {
  constructor(
    readonly id: number,
    readonly remoteAgent: string,
    /** How many layers the request has: postLayer takes 0 to layers - 1. */
    readonly layers: number,
    /** @internal The most bytes one layer moves, -1 if the engine cannot tell (the inline budget's clock). */
    readonly layerBytes = -1,
  ) {
    this.bytes = layerBytes < 0 ? -1 : layerBytes * layers;
  }
  /** @internal The most bytes a transfer() of it (every layer) moves, -1 if the engine cannot tell. */
  readonly bytes: number;
}

type Indices = Uint32Array | readonly number[];

/** Per-layer index arrays as one flat array and the layer bounds (layers + 1 offsets). */
function flatten(layers: ReadonlyArray<Indices>, side: string): { flat: Uint32Array; bounds: Uint32Array } {
  if (!Array.isArray(layers) || layers.length === 0)
    throw invalidParam(`makeLayeredXfer: ${side} layers must be a non-empty array of index arrays, one per layer`);
  const bounds = new Uint32Array(layers.length + 1);
  // A plain loop, not map: map skips the holes of a sparse array.
  const parts: Uint32Array[] = [];
  for (let l = 0; l < layers.length; l++) {
    const idx = layers[l];
    const a = idx instanceof Uint32Array ? idx : Array.isArray(idx) ? toIndices(idx) : undefined;
    if (!a) throw invalidParam(`makeLayeredXfer: ${side} layer ${l} must be a Uint32Array or an array of indices`);
    bounds[l + 1] = bounds[l] + a.length;
    parts.push(a);
  }
  const flat = new Uint32Array(bounds[layers.length]);
  for (let l = 0; l < parts.length; l++) flat.set(parts[l], bounds[l]);
  return { flat, bounds };
}

/** @internal NixlAgent.makeLayeredXfer. */
export function makeLayeredXfer(
  native: NativeAgent,
  op: XferOp,
  local: DlistHandle,
  localLayers: ReadonlyArray<Indices>,
  remote: DlistHandle,
  remoteLayers: ReadonlyArray<Indices>,
  notifMsg?: NotifMsg,
): LayeredXferHandle {
  const l = flatten(localLayers, 'local');
  const r = flatten(remoteLayers, 'remote');
  if (localLayers.length !== remoteLayers.length)
    throw invalidParam(`makeLayeredXfer: ${localLayers.length} local layers vs ${remoteLayers.length} remote layers`);
  for (let i = 0; i < localLayers.length; i++) {
    const nl = l.bounds[i + 1] - l.bounds[i];
    const nr = r.bounds[i + 1] - r.bounds[i];
    if (nl !== nr) throw invalidParam(`makeLayeredXfer: layer ${i} has ${nl} local vs ${nr} remote indices`);
  }
  const [id, layerBytes] = native.makeLayeredXferReq(
    op,
    local.id,
    l.flat,
    remote.id,
    r.flat,
    l.bounds,
    notifMsg,
    remote.agent,
  );
  return new LayeredXferHandle(id, remote.agent, localLayers.length, layerBytes);
}
