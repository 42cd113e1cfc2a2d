// A model-based random test of the Agent API, on either engine (the "model"
// here is the oracle: a state machine of what the Agent API promises; not an
// ML model, nor a generated test model). Agent A
// (this process) moves bytes to and from agent B (this process, or a child
// process) in random sequences of register / deregister, prep, make /
// initialize, transfer and re-post, wait (sometimes late), release,
// removeRemoteAgent, fill and close. The oracle predicts each outcome;
// where it cannot (a posting that may or may not have finished) it accepts
// either answer and follows the real one. Invariants:
//  - a resolved wait means that posting's bytes are in place (dest == source);
//  - a bad descriptor gets a typed error, and no byte outside registered
//    memory changes (canaries around every buffer, on both sides);
//  - every promise settles; nothing leaks (fds, mappings, threads).
// On the NIXL engine, where NIXL defines less, the oracle asks less:
//  - A knows B's memory only through the metadata it loaded (as across
//    processes), and posts nothing over remote memory B deregistered since:
//    NIXL leaves that undefined (the peer is to announce it first);
//  - removeRemoteAgent is refused while transfers to B are queued or running;
//  - requests complete in any order, so "drain" waits for each posted one, and
//    a request released while in flight counts as running until the end.
import * as fs from 'node:fs';
import fc from 'fast-check';
import { expect } from 'vitest';
import { DescList, NixlAgent, NixlError, type XferHandle, allocate } from '../lib';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const { setupAgent } = require('./fixtures/conformance-setup');

export type OracleEngine = 'loopback' | 'nixl';

/** An agent as the oracle test makes it on each engine. */
export function oracleAgent(name: string, engine: OracleEngine): NixlAgent {
  return setupAgent(NixlAgent, name, engine) as NixlAgent;
}

export const SIZE = 64 << 10;
export const CANARY = 64;
export const NBUF = 3;
const CANARY_BYTE = 0xa5;

/** Byte k of buffer j's data at fill generation g; side 0 = local, 1 = remote. */
export function patternByte(side: number, j: number, g: number, k: number): number {
  return (k * 131 + (j + side * 7) * 17 + g * 29 + (k >>> 9)) & 0xff;
}

export function fillPattern(buf: Uint8Array, side: number, j: number, g: number): void {
  for (let k = 0; k < buf.length; k++) buf[k] = patternByte(side, j, g, k);
}

/** A buffer with canaries on both sides; `data` is what gets registered. */
export function canaried(shared: boolean): { whole: Buffer; data: Buffer } {
  const whole = shared ? allocate(SIZE + 2 * CANARY) : Buffer.alloc(SIZE + 2 * CANARY);
  whole.fill(CANARY_BYTE);
  return { whole, data: whole.subarray(CANARY, CANARY + SIZE) };
}

export function canariesIntact(whole: Uint8Array): boolean {
  for (let k = 0; k < CANARY; k++)
    if (whole[k] !== CANARY_BYTE || whole[whole.length - 1 - k] !== CANARY_BYTE) return false;
  return true;
}

/** What the runs did, so that a reader can see the test reaches its cases. */
export const stats = {
  ops: 0,
  created: 0,
  refused: 0,
  posted: 0,
  postRefused: 0,
  verified: 0,
  waitFailed: 0,
  released: 0,
  scribbled: 0,
};

/** Agent B, wherever it runs. */
export interface RemoteSide {
  readonly name: string;
  readonly crossProcess: boolean;
  addr(j: number): bigint;
  /** 64 bytes registered on B for good: the drain probe reads them. */
  readonly probeAddr: bigint;
  register(j: number): Promise<void>;
  /** 'ok' or the error code. */
  deregister(j: number): Promise<string>;
  metadata(): Promise<Buffer>;
  read(j: number, off: number, len: number): Promise<Buffer>;
  canaries(): Promise<boolean>;
  fill(gen: number): Promise<void>;
  /** New bytes in one buffer (synchronously where B is in this process). */
  scribble(j: number, gen: number): Promise<void>;
  close(): Promise<void>;
}

// ---- operations --------------------------------------------------------------

type Kind = 'ok' | 'oob' | 'neg' | 'wrap';
interface PairSpec {
  lb: number;
  lo: number;
  rb: number;
  ro: number;
  frac: number;
  kind: Kind;
  side: 0 | 1;
  mismatch: boolean;
}
export type Op =
  | { t: 'regL' | 'deregL' | 'regR' | 'deregR'; i: number }
  | { t: 'reload' }
  | { t: 'xfer'; op: 'READ' | 'WRITE'; prepped: boolean; pairs: PairSpec[] }
  | { t: 'post'; h: number }
  | { t: 'wait'; h: number; mode: 'now' | 'spin' | 'sleep'; ms: number }
  | { t: 'waitLater'; h: number }
  | { t: 'release'; h: number }
  | { t: 'fill' }
  | { t: 'scribble'; side: 0 | 1; i: number }
  | { t: 'drain' };

const pairArb: fc.Arbitrary<PairSpec> = fc.record({
  lb: fc.nat(NBUF - 1),
  lo: fc.nat(SIZE - 1),
  rb: fc.nat(NBUF - 1),
  ro: fc.nat(SIZE - 1),
  frac: fc.integer({ min: 0, max: 1000 }).map((n) => n / 1000),
  kind: fc.oneof({ weight: 16, arbitrary: fc.constant<Kind>('ok') }, fc.constantFrom<Kind>('oob', 'neg', 'wrap')),
  side: fc.constantFrom<0 | 1>(0, 1),
  mismatch: fc.integer({ min: 0, max: 19 }).map((n) => n === 0),
});

export const opArb: fc.Arbitrary<Op> = fc.oneof(
  {
    weight: 1,
    arbitrary: fc.record({
      t: fc.constantFrom('regL', 'deregL', 'regR', 'deregR'),
      i: fc.nat(NBUF - 1),
    }) as fc.Arbitrary<Op>,
  },
  { weight: 1, arbitrary: fc.constant({ t: 'reload' } as Op) },
  {
    weight: 3,
    arbitrary: fc.record({
      t: fc.constant('xfer'),
      op: fc.constantFrom('READ', 'WRITE'),
      prepped: fc.boolean(),
      pairs: fc.array(pairArb, { minLength: 1, maxLength: 3 }),
    }) as fc.Arbitrary<Op>,
  },
  { weight: 5, arbitrary: fc.record({ t: fc.constant('post'), h: fc.nat(7) }) as fc.Arbitrary<Op> },
  {
    weight: 5,
    arbitrary: fc.record({
      t: fc.constant('wait'),
      h: fc.nat(7),
      mode: fc.constantFrom('now', 'spin', 'sleep'),
      ms: fc.nat(3),
    }) as fc.Arbitrary<Op>,
  },
  { weight: 1, arbitrary: fc.record({ t: fc.constant('waitLater'), h: fc.nat(7) }) as fc.Arbitrary<Op> },
  { weight: 1, arbitrary: fc.record({ t: fc.constant('release'), h: fc.nat(7) }) as fc.Arbitrary<Op> },
  { weight: 1, arbitrary: fc.constant({ t: 'fill' } as Op) },
  {
    weight: 3,
    arbitrary: fc.record({
      t: fc.constant('scribble'),
      side: fc.constantFrom<0 | 1>(0, 1),
      i: fc.nat(NBUF - 1),
    }) as fc.Arbitrary<Op>,
  },
  { weight: 2, arbitrary: fc.constant({ t: 'drain' } as Op) },
);

// ---- the oracle --------------------------------------------------------------

interface Range {
  side: 0 | 1;
  buf: number;
  off: number;
  len: number;
}
interface Pair {
  l: Range;
  r: Range;
}
interface Handle {
  h: XferHandle;
  op: 'READ' | 'WRITE';
  pairs: Pair[];
  localEpochs: number[]; // registration epoch of each local buffer at creation
  remoteEpochs: number[]; // epoch the remote entries refer to (see make())
  remoteGen: number; // removeRemoteAgent generation at creation
  state: 'idle' | 'posted' | 'done' | 'released';
  /** Posted, and the wait should fail (stale remote memory seen only at execution). */
  expectFail: boolean;
}

function overlaps(a: Range, b: Range): boolean {
  return a.side === b.side && a.buf === b.buf && a.off < b.off + b.len && b.off < a.off + a.len;
}

function code(e: unknown): string {
  expect(e, String(e)).toBeInstanceOf(NixlError);
  return (e as NixlError).code;
}

function attempt(f: () => unknown): string {
  try {
    f();
    return 'ok';
  } catch (e) {
    return code(e);
  }
}

export function countFds(): number {
  return fs.readdirSync('/proc/self/fd').length;
}

/** Mappings the engine makes: allocate() memory, peers' memfds, liveness tables. */
export function countMaps(): number {
  return fs
    .readFileSync('/proc/self/maps', 'utf8')
    .split('\n')
    .filter((l) => l.includes('memfd:nixl-node')).length;
}

export function countThreads(): number {
  return fs.readdirSync('/proc/self/task').length;
}

/** Runs one op sequence against A (created here) and the given B. */
export async function runOracle(
  ops: Op[],
  b: RemoteSide,
  tag: string,
  engine: OracleEngine = 'loopback',
): Promise<void> {
  const nixl = engine === 'nixl';
  // What A knows of B's registrations is what it loaded (see the header).
  const viewOnly = b.crossProcess || nixl;
  // Loopback: each copy waits 1 ms in the worker, so that a completion event
  // left from an earlier posting arrives while the next one is in flight.
  const a = nixl
    ? oracleAgent(`model-a-${tag}`, 'nixl')
    : new NixlAgent(`model-a-${tag}`, { engine: 'loopback', testDelayUs: 1000 });
  const local = Array.from({ length: NBUF }, (_, i) => canaried(i === 0));
  const localReg: Array<ReturnType<NixlAgent['registerMemory']> | undefined> = Array(NBUF).fill(undefined);
  const localEpoch = Array<number>(NBUF).fill(0); // 0: never registered
  const remoteEpoch = Array<number>(NBUF).fill(0); // current registration epoch on B (0: none)
  let loadedEpoch = Array<number>(NBUF).fill(0); // what A's loaded metadata of B says
  let remoteGen = 0;
  let epochs = 0;
  let gen = 0;
  let loaded = false;
  const handles: Handle[] = [];
  const pending: Array<Promise<unknown>> = [];
  let releasedInFlight: Handle[] = [];
  const probe = canaried(false);
  a.registerMemory(probe.data.subarray(0, 64));

  const remoteAddr = (r: Range) => b.addr(r.buf) + BigInt(r.off);
  const localAddr = (r: Range) => DescList.from(local[r.buf].data).addr(0) + BigInt(r.off);

  const reload = async () => {
    if (loaded && nixl && inFlight().length > 0) {
      const r = attempt(() => a.removeRemoteAgent(b.name));
      expect(['ok', 'NIXL_ERR_NOT_ALLOWED']).toContain(r);
      if (r !== 'ok') return;
    } else if (loaded) a.removeRemoteAgent(b.name);
    remoteGen++;
    a.addRemoteAgent(await b.metadata());
    loaded = true;
    loadedEpoch = [...remoteEpoch];
  };

  // Ops name a handle by index; they prefer the handles where they matter.
  const pick = (h: number, prefer: (x: Handle) => boolean): Handle | undefined => {
    const c = handles.filter(prefer);
    const from = c.length > 0 ? c : handles;
    return from.length > 0 ? from[h % from.length] : undefined;
  };
  const remoteStale = (x: Handle) => x.remoteEpochs.some((e, i) => e !== remoteEpoch[x.pairs[i].r.buf]);
  const inFlight = () => [...handles.filter((x) => x.state === 'posted'), ...releasedInFlight];
  const writes = (x: { op: string; pairs: Pair[] }) => x.pairs.map((p) => (x.op === 'READ' ? p.l : p.r));
  const reads = (x: { op: string; pairs: Pair[] }) => x.pairs.map((p) => (x.op === 'READ' ? p.r : p.l));

  // The loopback worker runs one agent's requests in order: once a probe
  // posted last completes, everything posted before it has run.
  const drain = async () => {
    if (nixl) {
      for (const x of handles) if (x.state === 'posted') await settle(x, a.wait(x.h, { timeoutMs: 10_000 }));
      return;
    }
    if (!loaded) return;
    await a.read(probe.data.subarray(0, 64), [{ addr: b.probeAddr, len: 64 }], b.name);
    for (const x of handles) if (x.state === 'posted') x.state = 'done';
    releasedInFlight = [];
  };

  const verify = async (x: Handle) => {
    for (const p of x.pairs) {
      const src =
        x.op === 'READ'
          ? await b.read(p.r.buf, p.r.off, p.r.len)
          : local[p.l.buf].data.subarray(p.l.off, p.l.off + p.l.len);
      const dst =
        x.op === 'READ'
          ? local[p.l.buf].data.subarray(p.l.off, p.l.off + p.l.len)
          : await b.read(p.r.buf, p.r.off, p.r.len);
      expect(
        Buffer.compare(Buffer.from(dst), Buffer.from(src)),
        `${x.op} ${JSON.stringify(p)} bytes not in place`,
      ).toBe(0);
    }
  };

  const settle = async (x: Handle, p: Promise<void>) => {
    try {
      await p;
      expect(x.expectFail, 'a transfer over deregistered remote memory succeeded').toBe(false);
      if (x.state === 'posted') x.state = 'done';
      stats.verified++;
      return verify(x);
    } catch (e) {
      const c = code(e);
      if (x.state === 'released' || c === 'NIXL_ERR_CANCELED') return;
      // Cross-process: memory deregistered after the post is seen by the worker.
      expect(x.expectFail || b.crossProcess, `wait rejected with ${c}`).toBe(true);
      expect(['NIXL_ERR_NOT_FOUND', 'NIXL_ERR_REMOTE_DISCONNECT']).toContain(c);
      stats.waitFailed++;
      if (x.state === 'posted') x.state = 'done';
    }
  };

  try {
    gen = 1;
    for (const [i, m] of local.entries()) fillPattern(m.data, 0, i, gen);
    await b.fill(gen);
    // Start with everything registered and known; the ops churn from there.
    for (let i = 0; i < NBUF; i++) {
      localReg[i] = a.registerMemory(local[i].data);
      localEpoch[i] = ++epochs;
      await b.register(i);
      remoteEpoch[i] = ++epochs;
    }
    await reload();
    for (const op of ops) {
      stats.ops++;
      switch (op.t) {
        case 'regL': {
          if (localReg[op.i]) break;
          localReg[op.i] = a.registerMemory(local[op.i].data);
          localEpoch[op.i] = ++epochs;
          break;
        }
        case 'deregL': {
          const reg = localReg[op.i];
          if (!reg) break;
          const users = inFlight().filter((x) =>
            x.pairs.some((p, k) => p.l.buf === op.i && x.localEpochs[k] === localEpoch[op.i]),
          );
          const r = attempt(() => a.deregisterMemory(reg));
          if (users.length === 0) expect(r).toBe('ok');
          else expect(['ok', 'NIXL_ERR_NOT_ALLOWED']).toContain(r);
          if (r === 'ok') {
            localReg[op.i] = undefined;
            localEpoch[op.i] = -localEpoch[op.i];
          }
          break;
        }
        case 'regR': {
          if (remoteEpoch[op.i] > 0) break;
          await b.register(op.i);
          remoteEpoch[op.i] = ++epochs;
          break;
        }
        case 'deregR': {
          if (remoteEpoch[op.i] <= 0) break;
          const users = inFlight().filter((x) => x.pairs.some((p) => p.r.buf === op.i));
          const r = await b.deregister(op.i);
          if (users.length === 0 || viewOnly)
            expect(r).toBe('ok'); // B pins nothing for A's requests
          else expect(['ok', 'NIXL_ERR_NOT_ALLOWED']).toContain(r);
          if (r === 'ok') remoteEpoch[op.i] = -remoteEpoch[op.i];
          break;
        }
        case 'reload':
          await reload();
          break;
        case 'xfer': {
          if (!loaded) await reload();
          const pairs: Pair[] = [];
          let valid = true;
          const lt: Array<{ addr: bigint; len: bigint }> = [];
          const rt: Array<{ addr: bigint; len: bigint }> = [];
          for (const s of op.pairs) {
            // Up to 8 KiB: small enough that postings rarely overlap.
            const max = Math.min(SIZE - s.lo, SIZE - s.ro, 8192);
            const len = 1 + Math.floor(s.frac * (max - 1));
            const l: Range = { side: 0, buf: s.lb, off: s.lo, len };
            const r: Range = { side: 1, buf: s.rb, off: s.ro, len };
            let la = localAddr(l);
            let ra = remoteAddr(r);
            let llen = BigInt(len);
            let rlen = BigInt(len);
            const bad = (addr: bigint, ln: bigint): [bigint, bigint] => {
              switch (s.kind) {
                case 'oob':
                  return [addr - BigInt(s.side ? s.ro : s.lo) + BigInt(SIZE - 8), 16n];
                case 'neg':
                  return [addr - BigInt(s.side ? s.ro : s.lo) - 8n, 16n];
                case 'wrap':
                  return [addr, (1n << 64n) - addr + 8n];
                default:
                  return [addr, ln];
              }
            };
            if (s.kind !== 'ok') {
              valid = false;
              if (s.side === 0) [la, llen] = bad(la, llen);
              else [ra, rlen] = bad(ra, rlen);
            }
            if (s.mismatch) {
              valid = false;
              rlen = llen + 1n;
            }
            lt.push({ addr: la, len: llen });
            rt.push({ addr: ra, len: rlen });
            pairs.push({ l, r });
          }
          // Registration state decides the rest of validity.
          const epochsOk =
            pairs.every((p) => localEpoch[p.l.buf] > 0) &&
            pairs.every((p) => loadedEpoch[p.r.buf] > 0 && (viewOnly || remoteEpoch[p.r.buf] > 0));
          const toList = (t: typeof lt) =>
            new DescList(
              BigUint64Array.from(t.flatMap((d) => [BigInt.asUintN(64, d.addr), BigInt.asUintN(64, d.len), 0n])),
            );
          let h: XferHandle | undefined;
          const r = attempt(() => {
            if (op.prepped) {
              const ld = a.prepXferDlist('', toList(lt));
              try {
                const rd = a.prepXferDlist(b.name, toList(rt));
                try {
                  const idx = Uint32Array.from(pairs.keys());
                  h = a.makePreppedXfer(op.op, ld, idx, rd, idx);
                } finally {
                  a.releaseDlistHandle(rd);
                }
              } finally {
                a.releaseDlistHandle(ld);
              }
            } else {
              h = a.initializeXfer(op.op, toList(lt), toList(rt), b.name);
            }
          });
          if (valid && epochsOk) {
            expect(r, `valid request refused: ${JSON.stringify(op)}`).toBe('ok');
          } else if (!valid) {
            expect(['NIXL_ERR_NOT_FOUND', 'NIXL_ERR_INVALID_PARAM']).toContain(r);
          } else {
            expect(r, `request on unregistered memory: ${JSON.stringify(op)}`).toBe('NIXL_ERR_NOT_FOUND');
          }
          if (r === 'ok') stats.created++;
          else stats.refused++;
          if (r === 'ok' && h) {
            // Same process: entries pin B's live regions (the current epoch).
            // Other process: they carry the loaded metadata's liveness word.
            handles.push({
              h,
              op: op.op,
              pairs,
              localEpochs: pairs.map((p) => localEpoch[p.l.buf]),
              remoteEpochs: pairs.map((p) => (viewOnly ? loadedEpoch[p.r.buf] : remoteEpoch[p.r.buf])),
              remoteGen,
              state: 'idle',
              expectFail: false,
            });
          }
          break;
        }
        case 'post': {
          const x = pick(op.h, (y) => y.state !== 'released' && y.state !== 'posted');
          if (!x) break;
          if (x.state === 'released') {
            expect(attempt(() => a.transfer(x.h))).toBe('NIXL_ERR_NOT_FOUND');
            break;
          }
          // Skip postings whose bytes would race another in-flight request.
          const conflicts = (y: { op: string; pairs: Pair[] }) =>
            writes(x).some((w) => [...writes(y), ...reads(y)].some((o) => overlaps(w, o))) ||
            reads(x).some((rd) => writes(y).some((o) => overlaps(rd, o)));
          if (writes(x).some((w, i) => writes(x).some((v, k) => k !== i && overlaps(w, v)))) break;
          let racy = false;
          for (const y of inFlight()) {
            if (y === x || !conflicts(y)) continue;
            // Maybe finished already: ask (its bytes are then final).
            if (y.state === 'posted' && a.checkXferState(y.h) !== 'PROC') y.state = 'done';
            else racy = true;
          }
          if (racy) break;
          // NIXL: posting over remote memory deregistered since the load is undefined.
          if (nixl && x.remoteGen === remoteGen && remoteStale(x)) break;
          const stale =
            x.remoteGen !== remoteGen
              ? 'NIXL_ERR_NOT_FOUND'
              : x.localEpochs.some((e, i) => e !== localEpoch[x.pairs[i].l.buf])
                ? 'NIXL_ERR_NOT_FOUND'
                : !viewOnly && x.remoteEpochs.some((e, i) => e !== remoteEpoch[x.pairs[i].r.buf])
                  ? 'NIXL_ERR_NOT_FOUND'
                  : 'ok';
          const r = attempt(() => a.transfer(x.h));
          if (x.state === 'posted') expect([stale, 'NIXL_ERR_REPOST_ACTIVE', 'ok']).toContain(r);
          else expect(r).toBe(stale);
          if (r === 'ok') stats.posted++;
          else stats.postRefused++;
          if (r === 'ok') {
            x.state = 'posted';
            x.expectFail = b.crossProcess && !nixl && remoteStale(x);
          }
          break;
        }
        case 'wait': {
          const x = pick(op.h, (y) => y.state === 'posted');
          if (!x) break;
          if (x.state === 'released') {
            await expect(a.wait(x.h)).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_FOUND' });
            break;
          }
          if (x.state === 'idle') {
            await expect(a.wait(x.h)).rejects.toMatchObject({ code: 'NIXL_ERR_NOT_POSTED' });
            break;
          }
          if (x.state === 'done') {
            // Settled before: resolves (or repeats its error) at once; its
            // bytes may have been overwritten since, by design.
            await a.wait(x.h, { timeoutMs: 10_000 }).catch((e) => {
              expect(['NIXL_ERR_NOT_FOUND', 'NIXL_ERR_REMOTE_DISCONNECT']).toContain(code(e));
            });
            break;
          }
          if (op.mode === 'spin') {
            const until = Date.now() + 5000;
            while (a.checkXferState(x.h) === 'PROC' && Date.now() < until) {
              /* keep the event queued */
            }
          } else if (op.mode === 'sleep') {
            await new Promise((r) => setTimeout(r, op.ms));
          }
          await settle(x, a.wait(x.h, { timeoutMs: 10_000 }));
          break;
        }
        case 'waitLater': {
          const x = pick(op.h, (y) => y.state === 'posted');
          if (!x) break;
          if (x.state !== 'posted') break;
          // Settled later: by completion, a re-post, a release or close.
          const expectFail = x.expectFail;
          pending.push(
            a.wait(x.h, { timeoutMs: 10_000 }).then(
              () => {
                expect(expectFail, 'a late wait resolved over deregistered memory').toBe(false);
              },
              (e) => {
                expect(['NIXL_ERR_CANCELED', 'NIXL_ERR_NOT_FOUND', 'NIXL_ERR_REMOTE_DISCONNECT']).toContain(code(e));
              },
            ),
          );
          break;
        }
        case 'release': {
          if (handles.length === 0) break;
          const x = handles[op.h % handles.length];
          const r = attempt(() => a.releaseXferHandle(x.h));
          stats.released++;
          expect(r).toBe(x.state === 'released' ? 'NIXL_ERR_NOT_FOUND' : 'ok');
          if (x.state === 'posted') releasedInFlight.push(x);
          x.state = 'released';
          break;
        }
        case 'drain':
          await drain();
          break;
        case 'scribble': {
          // New source bytes without draining, so that a completion event of
          // an earlier posting may still be queued: a wait settled by it
          // would show the old bytes. Only buffers no in-flight request touches.
          const busy = inFlight().some((x) => x.pairs.some((p) => (op.side === 0 ? p.l.buf : p.r.buf) === op.i));
          if (busy) break;
          gen++;
          stats.scribbled++;
          if (op.side === 0) fillPattern(local[op.i].data, 0, op.i, gen);
          else await b.scribble(op.i, gen);
          break;
        }
        case 'fill': {
          await drain();
          gen++;
          for (const [i, m] of local.entries()) fillPattern(m.data, 0, i, gen);
          await b.fill(gen);
          break;
        }
      }
      for (const m of local) expect(canariesIntact(m.whole), `local canary after ${op.t}`).toBe(true);
      expect(canariesIntact(probe.whole)).toBe(true);
    }
    expect(await b.canaries(), 'remote canaries').toBe(true);
  } finally {
    a.close();
  }
  // Every promise settles once the agent is closed.
  const all = await settledWithin(Promise.allSettled(pending), 5000);
  expect(all, 'promises left pending after close').not.toBe('timeout');
  for (const r of all as PromiseSettledResult<unknown>[]) if (r.status === 'rejected') throw r.reason;
}

// Module level, and the timer cleared: a pending timer's closure would keep
// the run's buffers alive and show up as a leak.
async function settledWithin<T>(p: Promise<T>, ms: number): Promise<T | 'timeout'> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<'timeout'>((r) => {
    timer = setTimeout(() => r('timeout'), ms);
  });
  try {
    return await Promise.race([p, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** fds, threads and mappings of this process, to compare before and after a run. */
export function resources(): { fds: number; threads: number; maps: number } {
  return { fds: countFds(), threads: countThreads(), maps: countMaps() };
}
