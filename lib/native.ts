// What the C++ addon (native/addon/) exports, and the one line that loads
// it. Only the modules that move bytes import this; the codec, the TP mapping
// and the errors load without the addon.
import * as path from 'node:path';
import { NixlError } from './errors';
import { useStatusTable } from './status-table';

export interface NativeAgentOptions {
  engine: 'loopback' | 'nixl';
  backends: string[];
  progressThread?: boolean;
  progressDelayUs?: number;
  captureTelemetry?: boolean;
  listenPort?: number;
  testDelayUs?: number;
  testFirstHandle?: number;
  inlinePostMaxBytes?: number;
  inlinePostMaxUs?: number;
}

/** A finished transfer's telemetry: when it started, how long posting and the transfer took, bytes and descriptors. */
export interface NativeTelemetry {
  startTimeUs: number;
  postDurationUs: number;
  xferDurationUs: number;
  totalBytes: number;
  descCount: number;
}

export declare class NativeAgent {
  constructor(name: string, options: NativeAgentOptions, onEvents: (done: Float64Array, notif: boolean) => void);
  readonly engine: string;
  getPluginList(): string[];
  getPluginParams(plugin: string): { params: Record<string, string>; memTypes: string[] };
  getBackendParams(backend: string): { params: Record<string, string>; memTypes: string[] };
  queryXferBackend(h: number): string;
  createBackend(plugin: string, params?: Record<string, string>): void;
  getBackends(): string[];
  registerMem(descs: BigUint64Array, memType: number, backends: string[] | undefined, keep: unknown[]): number;
  deregisterMem(reg: number): void;
  getLocalMD(): Buffer;
  loadRemoteMD(md: Uint8Array): string;
  invalidateRemoteMD(agent: string): void;
  getLocalPartialMD(descs: BigUint64Array, memType: number, includeConnInfo: boolean, backends?: string[]): Buffer;
  sendLocalMD(ip?: string, port?: number): void;
  sendLocalPartialMD(
    descs: BigUint64Array,
    memType: number,
    includeConnInfo: boolean,
    backends: string[] | undefined,
    ip?: string,
    port?: number,
    label?: string,
  ): void;
  fetchRemoteMD(agent: string, ip?: string, port?: number, label?: string): void;
  invalidateLocalMD(ip?: string, port?: number): void;
  checkRemoteMD(agent: string, descs: BigUint64Array, memType: number): boolean;
  makeConnection(agent: string): void;
  queryMem(descs: BigUint64Array, memType: number, backends?: string[]): Array<Record<string, string> | null>;
  estimateXferCost(h: number): { durationUs: number; errMarginUs: number; method: string };
  prepXferDlist(agent: string, descs: BigUint64Array, memType: number, backends?: string[]): number;
  releaseDlist(h: number): void;
  makeXferReq(
    op: 'READ' | 'WRITE',
    local: number,
    localIdx: Uint32Array,
    remote: number,
    remoteIdx: Uint32Array,
    notif?: Uint8Array | string,
  ): number;
  createXferReq(
    op: 'READ' | 'WRITE',
    local: BigUint64Array,
    localType: number,
    remote: BigUint64Array,
    remoteType: number,
    agent: string,
    notif?: Uint8Array | string,
  ): number;
  makeLayeredXferReq(
    op: 'READ' | 'WRITE',
    local: number,
    localIdx: Uint32Array,
    remote: number,
    remoteIdx: Uint32Array,
    bounds: Uint32Array,
    notif: Uint8Array | string | undefined,
    remoteAgent: string,
  ): [handle: number, maxLayerBytes: number];
  /**
   * The agent's layer poster: postLayer(h, layer, mayInline) -> the layered request's status after posting the
   * layer (1 = in progress). A function, not a method: the addon finds its agent without unwrapping `this`.
   */
  layerPoster(): (h: number, layer: number, mayInline: boolean) => number;
  /**
   * The agent's transfer poster: postXfer(h, mayInline, notif?), as postXferReq, without unwrapping `this`;
   * called with two arguments when there is no message, the addon asks no third's type.
   */
  xferPoster(): (h: number, mayInline: boolean, notif?: Uint8Array | string) => number;
  /** 1 = in progress (a completion event follows), 0 = already done */
  /** mayInline false: through the engine's thread whatever the size. */
  postXferReq(h: number, notif?: Uint8Array | string, mayInline?: boolean): number;
  /** The bytes a request moves (its local side), -1 if the engine cannot tell. */
  xferBytes(h: number): number;
  /** status number, or [status, message] for an error status */
  getXferStatus(h: number): number | [number, string];
  releaseXferReq(h: number): void;
  getXferTelemetry(h: number): NativeTelemetry;
  genNotif(agent: string, msg: Uint8Array | string): void;
  /** [from0, msg0, from1, msg1, ...] */
  getNotifs(): Array<string | Buffer>;
  watchNotifs(on: boolean): void;
  close(): void;
}

export interface Binding {
  NativeAgent: typeof NativeAgent;
  allocate(bytes: number): Buffer;
  addressOf(mem: ArrayBufferView | ArrayBuffer): bigint;
  /** The addon makes every error through this (status names live in lib/errors.ts only). */
  setErrorFactory(make: (message: string, status: number) => Error): void;
  engines: string[];
  /** NIXL's status codes as the nixl_types.h the addon was built against names them. */
  statusCodes: Record<string, number>;
  /** Where statusCodes came from: the installed header, or the checked-in fallback. */
  statusSource: string;
}

// lib/ and dist/lib/ both resolve the package root two or one levels up.
function packageRoot(): string {
  const up1 = path.join(__dirname, '..');
  return path.basename(up1) === 'dist' ? path.join(up1, '..') : up1;
}

// NIXL_NODE_ADDON points at another build of the addon (CI's sanitizer build).
/* eslint-disable @typescript-eslint/no-require-imports */
export const binding: Binding = process.env.NIXL_NODE_ADDON
  ? require(path.resolve(process.env.NIXL_NODE_ADDON))
  : require('node-gyp-build')(packageRoot());

if (binding.statusCodes) useStatusTable(binding.statusCodes, binding.statusSource);
binding.setErrorFactory((message, status) => NixlError.fromStatus(status, message));
