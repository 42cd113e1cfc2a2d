// The typed Agent API. Method names mirror NIXL's Python API (nixl._api) in
// camelCase; promise forms (wait/read/write/waitForNotif) are resolved from
// the addon's batched completion events.
import { markAsUntransferable } from 'node:worker_threads';
import { DescList, type MemType, type MemoryLike, memTypeId, toDescList, toIndices } from '../descriptors';
import { NixlError, invalidParam } from '../errors';
import { binding, type NativeAgent, type NativeTelemetry } from '../native';
import { explainLoadFailure, prepareUcxEnv, ucxErrorMode } from '../ucx';
import { backendParams, defaultEngine, metadataLabel } from './config';
import { inlineBudgetLeftFor, inlinePostModeFor, settledNow } from './inline-budget';
import { LayeredXferHandle, makeLayeredXfer } from './layered-xfer';
import { NotifInbox } from './notifs';
import { oneShot } from './one-shot';
import { type NativeStatus, errorOf, neverPosted, stateOf } from './status';
import {
  type AgentOptions,
  type BackendParams,
  DEFAULT_INLINE_POST_MAX_BYTES,
  DEFAULT_INLINE_POST_MAX_US,
  DlistHandle,
  type EngineKind,
  type Notif,
  type NotifMsg,
  RegisteredMemory,
  type WaitOptions,
  XferHandle,
  type XferOp,
  type XferOptions,
  type XferState,
} from './types';
import { XferWaits } from './waits';

/**
 * A NIXL agent: registers memory, exchanges metadata with peers, and posts
 * transfers between its memory and theirs. The method names are those of NIXL's
 * Python API (nixl._api), in camelCase. Transfers complete on the engine's thread;
 * `wait` and the one-shot `read` / `write` resolve on the event loop.
 */
export class NixlAgent {
  readonly name: string;
  readonly #native: NativeAgent;
  readonly #postLayer: ReturnType<NativeAgent['layerPoster']>;
  readonly #postXfer: ReturnType<NativeAgent['xferPoster']>;
  readonly #waits = new XferWaits();
  // The same map as #waits.byId: the post path checks it without a call.
  readonly #waiters = this.#waits.byId;
  readonly #inbox: NotifInbox;
  #closed = false;

  constructor(name: string, options: AgentOptions = {}) {
    if (typeof name !== 'string' || name.length === 0) throw invalidParam('agent name must be a non-empty string');
    const engine = options.engine ?? defaultEngine();
    const backends = options.backends ?? (engine === 'nixl' ? ['UCX'] : ['LOOPBACK']);
    if (engine === 'nixl') prepareUcxEnv(); // before NIXL first loads UCX
    this.name = name;
    this.#native = new binding.NativeAgent(
      name,
      {
        engine,
        backends: [],
        progressThread: options.progressThread,
        progressDelayUs: options.progressDelayUs,
        captureTelemetry: options.captureTelemetry,
        listenPort: options.listenPort,
        testDelayUs: options.testDelayUs,
        testFirstHandle: options.testFirstHandle,
        inlinePostMaxBytes: options.inlinePostMaxBytes ?? DEFAULT_INLINE_POST_MAX_BYTES,
        inlinePostMaxUs: options.inlinePostMaxUs ?? DEFAULT_INLINE_POST_MAX_US,
      },
      (done, notif) => this.#onEvents(done, notif),
    );
    this.#inbox = new NotifInbox(this.#native, () => this.#closed);
    this.#postLayer = this.#native.layerPoster();
    this.#postXfer = this.#native.xferPoster();
    try {
      for (const b of backends) this.#native.createBackend(b, backendParams(engine, b, options.backendParams?.[b]));
    } catch (e) {
      this.#native.close();
      throw e;
    }
  }

  /** 'loopback' or 'nixl': the engine this agent runs on. */
  get engine(): EngineKind {
    return this.#native.engine as EngineKind;
  }

  get closed(): boolean {
    return this.#closed;
  }

  // ---- backends -------------------------------------------------------------

  /** The backend plugins this engine can create (NIXL get_plugin_list). */
  getPluginList(): string[] {
    return this.#native.getPluginList();
  }

  /** A plugin's parameters and the memory types it handles (NIXL get_plugin_params). */
  getPluginParams(plugin: string): { params: Record<string, string>; memTypes: string[] } {
    return this.#native.getPluginParams(plugin);
  }

  /** Creates a backend of a plugin with these parameters (NIXL create_backend). */
  createBackend(plugin: string, params: Record<string, string> = {}): void {
    this.#native.createBackend(plugin, params);
  }

  /** The backends this agent has created. */
  getBackends(): string[] {
    return this.#native.getBackends();
  }

  /**
   * A created backend's parameters as it runs, defaults included, and the
   * memory types it handles (NIXL get_backend_params / getBackendParams).
   * NIXL_ERR_NOT_FOUND for a backend this agent did not create.
   */
  getBackendParams(backend: string): BackendParams {
    return this.#native.getBackendParams(backend);
  }

  // ---- memory ---------------------------------------------------------------

  /** Descriptors for transfers (NIXL get_xfer_descs). */
  getXferDescs(mem: DescList | MemoryLike | readonly MemoryLike[], memType: MemType = 'DRAM'): DescList {
    return toDescList(mem, memType);
  }

  /**
   * Registers memory with the agent's backends (NIXL register_memory). The
   * buffers stay valid until deregistered: they are marked untransferable so that
   * postMessage cannot detach them.
   */
  registerMemory(
    mem: DescList | MemoryLike | readonly MemoryLike[],
    opts: { memType?: MemType; backends?: string[] } = {},
  ): RegisteredMemory {
    const d = toDescList(mem, opts.memType);
    const id = this.#native.registerMem(d.triples, memTypeId(d.memType), opts.backends, [...d.owners]);
    // A transfer (postMessage, structuredClone) would detach the ArrayBuffer
    // and hand its memory to a clone that can be collected under a copy. Node
    // copies untransferable buffers instead, as it does for its Buffer pool.
    // The mark is permanent: it outlives deregistration.
    for (const o of d.owners) markAsUntransferable(ArrayBuffer.isView(o) ? o.buffer : o);
    return new RegisteredMemory(id, d);
  }

  /** Deregisters what registerMemory returned (NIXL deregister_memory). */
  deregisterMemory(reg: RegisteredMemory): void {
    if (!(reg instanceof RegisteredMemory)) throw invalidParam('deregisterMemory expects what registerMemory returned');
    this.#native.deregisterMem(reg.id);
  }

  // ---- metadata -------------------------------------------------------------

  /** This agent's metadata, for a peer's addRemoteAgent (NIXL get_agent_metadata). */
  getAgentMetadata(): Buffer {
    return this.#native.getLocalMD();
  }

  /** Loads a peer's metadata; returns its agent name. */
  addRemoteAgent(metadata: Uint8Array): string {
    if (!(metadata instanceof Uint8Array)) throw invalidParam('addRemoteAgent expects the metadata Buffer');
    try {
      return this.#native.loadRemoteMD(metadata);
    } catch (e) {
      throw this.engine === 'nixl' ? explainLoadFailure(e, ucxErrorMode(this)) : e;
    }
  }

  /** Forgets a peer's metadata (NIXL remove_remote_agent); its transfers fail from then on. */
  removeRemoteAgent(agent: string): void {
    this.#native.invalidateRemoteMD(agent);
  }

  /** Metadata of only the registrations covering descs (NIXL get_partial_agent_metadata). */
  getPartialAgentMetadata(
    descs: DescList | MemoryLike | readonly MemoryLike[],
    opts: { memType?: MemType; includeConnInfo?: boolean; backends?: string[] } = {},
  ): Buffer {
    const d = toDescList(descs, opts.memType);
    return this.#native.getLocalPartialMD(
      d.triples,
      memTypeId(d.memType),
      opts.includeConnInfo ?? false,
      opts.backends,
    );
  }

  // NIXL's own metadata exchange: a peer's listener (ip, port; the peer sets
  // listenPort) or etcd when no ip is given (NIXL_ETCD_ENDPOINTS; keys
  // <NIXL_ETCD_NAMESPACE>/<agent>/<label>, docs/fleet.md). The loopback
  // engine has neither and says so (NIXL_ERR_NOT_SUPPORTED); use
  // lib/handshake there.

  /** Sends this agent's metadata to a peer's listener, or to etcd without an ip (NIXL send_local_metadata). */
  sendLocalMetadata(opts: { ip?: string; port?: number } = {}): void {
    this.#native.sendLocalMD(opts.ip, opts.port);
  }

  /**
   * Sends the metadata of the registrations covering descs only (NIXL
   * send_partial_agent_metadata), with the backends' connection info if
   * asked, to a peer's listener, or to etcd without an ip: there under
   * `label` (required; a peer fetches it with the same label).
   */
  sendPartialAgentMetadata(
    descs: DescList | MemoryLike | readonly MemoryLike[],
    opts: {
      memType?: MemType;
      includeConnInfo?: boolean;
      backends?: string[];
      ip?: string;
      port?: number;
      label?: string;
    } = {},
  ): void {
    const d = toDescList(descs, opts.memType);
    const label = metadataLabel(opts.label);
    if (!opts.ip && label === undefined)
      throw invalidParam(
        'sendPartialAgentMetadata without an ip goes to the metadata server (etcd), which needs a label: ' +
          "the key it is stored under (fetchRemoteMetadata(agent, { label }) reads it); 'metadata' is the full metadata's",
      );
    this.#native.sendLocalPartialMD(
      d.triples,
      memTypeId(d.memType),
      opts.includeConnInfo ?? false,
      opts.backends,
      opts.ip,
      opts.port,
      label,
    );
  }

  /**
   * Asks a peer's listener (or etcd, without an ip) for an agent's metadata
   * (NIXL fetch_remote_metadata); from etcd, the metadata sent under `label`
   * (default: the full metadata). It arrives later: see checkRemoteMetadata.
   */
  fetchRemoteMetadata(remoteAgent: string, opts: { ip?: string; port?: number; label?: string } = {}): void {
    this.#native.fetchRemoteMD(remoteAgent, opts.ip, opts.port, metadataLabel(opts.label));
  }

  /** Tells peers (or etcd) to forget this agent's metadata (NIXL invalidate_local_metadata). */
  invalidateLocalMetadata(opts: { ip?: string; port?: number } = {}): void {
    this.#native.invalidateLocalMD(opts.ip, opts.port);
  }

  /** True when the agent's metadata (and memory covering descs, if given) has arrived. */
  checkRemoteMetadata(
    remoteAgent: string,
    descs?: DescList | readonly MemoryLike[],
    memType: MemType = 'DRAM',
  ): boolean {
    const d = descs ? toDescList(descs, memType) : new DescList(new BigUint64Array(0), memType);
    return this.#native.checkRemoteMD(remoteAgent, d.triples, memTypeId(d.memType));
  }

  /** Connects to a peer ahead of the first transfer (NIXL make_connection). */
  makeConnection(remoteAgent: string): void {
    this.#native.makeConnection(remoteAgent);
  }

  /** Per descriptor: what the backend knows of that memory, or null. */
  queryMemory(
    descs: DescList | MemoryLike | readonly MemoryLike[],
    opts: { memType?: MemType; backends?: string[] } = {},
  ): Array<Record<string, string> | null> {
    const d = toDescList(descs, opts.memType);
    // NIXL asks for exactly one backend here; with one created, that is the one.
    const backends = opts.backends ?? (this.getBackends().length === 1 ? this.getBackends() : undefined);
    return this.#native.queryMem(d.triples, memTypeId(d.memType), backends);
  }

  // ---- transfers ------------------------------------------------------------

  /** agent '' or 'NIXL_INIT_AGENT' prepares the local side. */
  prepXferDlist(
    agent: string,
    descs: DescList | MemoryLike | readonly MemoryLike[],
    opts: { memType?: MemType; backends?: string[] } = {},
  ): DlistHandle {
    const local = agent === '' || agent === 'NIXL_INIT_AGENT';
    const d = toDescList(descs, opts.memType);
    const id = this.#native.prepXferDlist(local ? '' : agent, d.triples, memTypeId(d.memType), opts.backends);
    return new DlistHandle(id, local ? '' : agent, d.length);
  }

  /** A transfer between entries of two prepared lists (NIXL make_prepped_xfer); post it with transfer. */
  makePreppedXfer(
    op: XferOp,
    local: DlistHandle,
    localIndices: Uint32Array | readonly number[],
    remote: DlistHandle,
    remoteIndices: Uint32Array | readonly number[],
    notifMsg?: NotifMsg,
  ): XferHandle {
    const id = this.#native.makeXferReq(
      op,
      local.id,
      toIndices(localIndices),
      remote.id,
      toIndices(remoteIndices),
      notifMsg,
    );
    return new XferHandle(id, remote.agent, this.#native.xferBytes(id));
  }

  /**
   * A layered transfer between entries of two prepared lists: per layer, the
   * local and remote indices of its blocks. Post each layer with postLayer as
   * it is ready; the request completes once (one wait, one notification, sent
   * after every layer's bytes are in place). See docs/agent-api.md.
   */
  makeLayeredXfer(
    op: XferOp,
    local: DlistHandle,
    localLayers: ReadonlyArray<Uint32Array | readonly number[]>,
    remote: DlistHandle,
    remoteLayers: ReadonlyArray<Uint32Array | readonly number[]>,
    notifMsg?: NotifMsg,
  ): LayeredXferHandle {
    return makeLayeredXfer(this.#native, op, local, localLayers, remote, remoteLayers, notifMsg);
  }

  /**
   * Posts one layer of a layered transfer: the request's state after it
   * ('PROC' until the last layer is done). The first layer posted after a
   * finished posting starts a new one. Small layers are copied inline as
   * transfer() posts.
   */
  postLayer(handle: LayeredXferHandle, layer: number): XferState {
    return this.#endedByPost(
      handle,
      stateOf(this.#postLayer(handle.id, layer, inlineBudgetLeftFor(handle.layerBytes))),
    );
  }

  /** A transfer between two descriptor lists (NIXL initialize_xfer); post it with transfer, then wait. */
  initializeXfer(
    op: XferOp,
    local: DescList | MemoryLike | readonly MemoryLike[],
    remote: DescList | readonly MemoryLike[] | MemoryLike,
    remoteAgent: string,
    notifMsg?: NotifMsg,
  ): XferHandle {
    const l = toDescList(local);
    const r = toDescList(remote);
    const id = this.#native.createXferReq(
      op,
      l.triples,
      memTypeId(l.memType),
      r.triples,
      memTypeId(r.memType),
      remoteAgent,
      notifMsg,
    );
    return new XferHandle(id, remoteAgent, this.#native.xferBytes(id));
  }

  /** Posts (or re-posts) a transfer; notifMsg replaces the request's message. */
  transfer(handle: XferHandle, notifMsg?: NotifMsg): XferState {
    // Waiters left from the previous posting (finished, its event not yet
    // delivered) are settled now, so a wait never spans two postings.
    if (this.#waiters.size !== 0 && this.#waiters.has(handle.id)) this.#statusNow(handle.id);
    const mode = inlinePostModeFor(handle.bytes, !(handle instanceof LayeredXferHandle));
    const mayInline = mode !== 'engine';
    // Without a message the poster gets two arguments: the addon reads no third.
    const s = stateOf(
      notifMsg === undefined ? this.#postXfer(handle.id, mayInline) : this.#postXfer(handle.id, mayInline, notifMsg),
    );
    // Past the turn's budget a post finished inline reads as unfinished: its
    // waits settle at the next turn (settledNow), so the caller's loop yields.
    // Nothing waits on it yet: only a single request is late (never a layered
    // one, whose earlier layers may have waits), and a repost of one still in
    // flight throws.
    if (mode === 'late' && s === 'DONE') return 'PROC';
    return this.#endedByPost(handle, s);
  }

  // A post that ends a posting on this thread (a transfer finished inline, a
  // layered request's last layer) sends no completion event: the waits on it
  // (a layered posting may have some) settle here.
  #endedByPost(handle: XferHandle | LayeredXferHandle, s: XferState): XferState {
    if (s !== 'PROC' && this.#waiters.size !== 0 && this.#waiters.has(handle.id))
      this.#waits.settle(handle.id, this.getXferError(handle));
    return s;
  }

  /** A posted transfer's state (NIXL check_xfer_state); throws if it was never posted. */
  checkXferState(handle: XferHandle): XferState {
    const s = this.#statusNow(handle.id);
    if (neverPosted(s)) throw NixlError.fromStatus(-1, 'checkXferState: transfer was never posted');
    return stateOf(s);
  }

  /** The error of a transfer in state ERR, else undefined. */
  getXferError(handle: XferHandle): NixlError | undefined {
    return errorOf(this.#statusNow(handle.id));
  }

  // NIXL's state check may itself find a transfer done (check_xfer_state
  // progresses it), and then no completion event follows: waits already
  // pending on it settle here.
  #statusNow(id: number): NativeStatus {
    const s = this.#native.getXferStatus(id);
    if (this.#waiters.has(id) && stateOf(s) !== 'PROC' && !neverPosted(s)) this.#waits.settle(id, errorOf(s));
    return s;
  }

  /** The backend that serves a transfer request, by name (NIXL query_xfer_backend / queryXferBackend). */
  queryXferBackend(handle: XferHandle): string {
    return this.#native.queryXferBackend(handle.id);
  }

  /** Releases a transfer request; a wait on it rejects with NIXL_ERR_CANCELED. */
  releaseXferHandle(handle: XferHandle): void {
    this.#native.releaseXferReq(handle.id);
    if (this.#waiters.has(handle.id))
      this.#waits.settle(handle.id, new NixlError('transfer handle was released', 'NIXL_ERR_CANCELED'));
  }

  /** Releases a prepared descriptor list (NIXL release_dlist_handle). */
  releaseDlistHandle(handle: DlistHandle): void {
    this.#native.releaseDlist(handle.id);
  }

  /** The backend's estimate of a prepared transfer's duration. */
  estimateXferCost(handle: XferHandle): { durationUs: number; errMarginUs: number; method: string } {
    return this.#native.estimateXferCost(handle.id);
  }

  /** The telemetry of a finished transfer (the agent needs captureTelemetry). */
  getXferTelemetry(handle: XferHandle): NativeTelemetry {
    return this.#native.getXferTelemetry(handle.id);
  }

  /** Resolves when the posted transfer is DONE; rejects with its NixlError on ERR. */
  wait(handle: XferHandle, opts: WaitOptions = {}): Promise<void> {
    let s: NativeStatus;
    try {
      // Through #statusNow: the check may itself find the transfer done (no
      // completion event follows), and the waits already pending settle too.
      s = this.#statusNow(handle.id);
    } catch (e) {
      return Promise.reject(e);
    }
    const state = stateOf(s);
    if (state === 'DONE') return settledNow();
    if (state === 'ERR') {
      const [st, msg] = s as [number, string];
      const err = NixlError.fromStatus(st, st === -1 ? 'wait: transfer was never posted' : msg);
      return settledNow().then(() => Promise.reject(err));
    }
    return this.#waits.add(handle.id, opts);
  }

  /** initializeXfer + transfer + wait + release, in one call. */
  async read(
    local: DescList | MemoryLike | readonly MemoryLike[],
    remote: DescList | readonly MemoryLike[] | MemoryLike,
    remoteAgent: string,
    opts: XferOptions = {},
  ): Promise<void> {
    return oneShot(this, 'READ', local, remote, remoteAgent, opts);
  }

  /** Writes local memory into a peer's and waits for it: initializeXfer, transfer and wait in one call. */
  async write(
    local: DescList | MemoryLike | readonly MemoryLike[],
    remote: DescList | readonly MemoryLike[] | MemoryLike,
    remoteAgent: string,
    opts: XferOptions = {},
  ): Promise<void> {
    return oneShot(this, 'WRITE', local, remote, remoteAgent, opts);
  }

  // ---- notifications --------------------------------------------------------

  /** Sends a notification to a peer agent (NIXL send_notif). */
  sendNotif(remoteAgent: string, msg: NotifMsg): void {
    this.#native.genNotif(remoteAgent, msg);
  }

  /** All notifications received since the last call, by sender. */
  getNewNotifs(): Map<string, Buffer[]> {
    return this.#inbox.takeAll();
  }

  /**
   * Resolves with the first notification (consumed, not returned again by
   * getNewNotifs) that matches: a sender name, an exact message, or a predicate.
   */
  waitForNotif(
    match: { agent?: string; msg?: NotifMsg } | ((n: Notif) => boolean) = {},
    opts: WaitOptions = {},
  ): Promise<Notif> {
    if (this.#closed) return Promise.reject(new NixlError(`agent '${this.name}' is closed`, 'NIXL_ERR_NOT_ALLOWED'));
    return this.#inbox.waitFor(match, opts);
  }

  /** Closes the agent: pending waits reject, its memory is deregistered, later calls throw. */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#native.close();
    const err = new NixlError(`agent '${this.name}' was closed`, 'NIXL_ERR_CANCELED');
    this.#waits.rejectAll(err);
    this.#inbox.rejectAll(err);
  }

  /** Closes the agent (`using agent = new NixlAgent(...)`). */
  [Symbol.dispose](): void {
    this.close();
  }

  // ---- internals ------------------------------------------------------------

  #onEvents(done: Float64Array, notif: boolean): void {
    if (this.#closed) return;
    for (const id of done) {
      if (!this.#waiters.has(id)) continue;
      let s: NativeStatus;
      try {
        s = this.#native.getXferStatus(id);
      } catch (e) {
        this.#waits.settle(id, e as Error);
        continue;
      }
      // The event of an earlier posting, delivered after the handle was
      // posted again: this posting's own event is still to come.
      if (stateOf(s) === 'PROC') continue;
      this.#waits.settle(id, errorOf(s));
    }
    if (notif || this.#inbox.watched) this.#inbox.deliver();
  }
}
