// nixl-node demo / npm run demo [-- --prefill-tp 2 --decode-tp 4 --layers 32 --blocks 256 --block-kib 64
//                  --requests 16 --method zmq|http --engine loopback|nixl --mla]
// A prefill worker and decode workers as real processes: handshake, pull a
// realistic KV cache, check every byte, print what happened.
import { constants as bufferConstants } from 'node:buffer';
import { fork } from 'node:child_process';
import * as os from 'node:os';
import * as path from 'node:path';
import { execFileSync } from 'node:child_process';
import { NixlError, engines } from '../lib';
import { computeCompatibilityHash } from '../lib/handshake';
import { targetRemoteRanks } from '../lib/kv';
import { nativeProgram } from '../lib/native-program';
import type { DecodeConfig, DemoRequest, RoundReport } from './decode-worker';
import { median, printBreakdown } from './report';
import { type DemoResult, type NativeBaseline, writeDemoResult } from './result';
import type { PrefillConfig } from './prefill-worker';
import { rankBytes, rankDims, type KvSpec } from './kvpattern';

/**
 * Where NIXL's own progress thread runs. 'prefill': on the prefill's agents
 * only. A decode rank only starts READs, and the engine's poll thread
 * progresses those; on one host UCX copies them (cma) inside the progress
 * call that holds the worker's lock, and a second thread progressing the
 * same worker spins on that lock for the whole copy, doubling the CPU a byte
 * costs. A prefill's agents serve reads (UCX over TCP needs the target to
 * progress), so they keep it.
 */
export type ProgressThreadMode = 'prefill' | 'both' | 'none';

/** What the demo runs (cli/demo.ts parses them from the command line). */
export interface DemoOptions {
  prefillTp: number;
  decodeTp: number;
  layers: number;
  blocks: number;
  blockKib: number;
  heads: number;
  requests: number;
  inFlight: number;
  rounds: number;
  method: 'zmq' | 'http';
  engine: 'loopback' | 'nixl';
  /** Which agents run NIXL's own progress thread (nixl engine). */
  progressThread: ProgressThreadMode;
  mla: boolean;
  /** Also write what ran and was measured here as JSON (demo/result.ts). */
  json?: string;
}

/**
 * Refuses options the demo cannot run with (NIXL_ERR_INVALID_PARAM: the
 * command answers one line and exit code 2).
 */
export function checkDemoOptions(o: DemoOptions): void {
  const bad = (m: string) => new NixlError(m, 'NIXL_ERR_INVALID_PARAM');
  if (o.progressThread !== 'prefill' && o.engine !== 'nixl')
    throw bad(
      `${o.progressThread === 'none' ? '--no-progress-thread' : `--progress-thread ${o.progressThread}`}: only with --engine nixl`,
    );
  if (o.engine === 'nixl' && !engines.includes('nixl'))
    throw bad('--engine nixl: NIXL is not compiled in (install NIXL, set NIXL_PREFIX and rebuild)');
  if (!o.mla && (o.heads % o.prefillTp || o.heads % o.decodeTp))
    throw bad(`${o.heads} heads must split over both TP sizes`);
  if (o.requests > o.blocks) throw bad('--requests must not exceed --blocks');
  if (!o.mla && (o.blockKib * 1024) % o.heads) throw bad('--block-kib x 1024 must split over --heads');
  checkMemory(o);
}

// Refuses, before allocating anything, sizes that cannot be held: one
// rank's KV must fit in one Buffer, and all ranks together in free memory.
function checkMemory(o: DemoOptions): void {
  const regions = o.mla ? o.layers : o.layers * 2;
  const headBytes = o.mla ? o.blockKib * 1024 : (o.blockKib * 1024) / o.heads;
  const base = { heads: o.heads, headBytes, numBlocks: o.blocks, regions, mla: o.mla };
  const p = rankBytes({ ...base, tpSize: o.prefillTp, tpRank: 0 });
  const d = rankBytes({ ...base, tpSize: o.decodeTp, tpRank: 0 });
  const biggest = Math.max(p, d);
  if (biggest > bufferConstants.MAX_LENGTH) {
    throw new NixlError(
      `one rank would hold ${fmt(biggest)} of KV, more than one Buffer can (${fmt(bufferConstants.MAX_LENGTH)}); use fewer --layers, --blocks or --block-kib`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }
  const total = p * o.prefillTp + d * o.decodeTp;
  if (total > os.freemem() * 0.8) {
    throw new NixlError(
      `the demo needs ${fmt(total)} of KV in memory, and ${fmt(os.freemem())} is free; use fewer --layers, --blocks or --block-kib`,
      'NIXL_ERR_INVALID_PARAM',
    );
  }
}

const PROGRESS_TEXT: Record<ProgressThreadMode, string> = {
  prefill:
    " (NIXL's progress thread on the prefill's agents only; the engine's poll thread progresses the decode ranks)",
  both: " (NIXL's progress thread on every agent)",
  none: " (NIXL's progress thread off: the engine's poll thread progresses every agent)",
};

const GiB = 2 ** 30;
const fmt = (b: number) => (b >= GiB ? `${(b / GiB).toFixed(2)} GiB` : `${(b / 2 ** 20).toFixed(1)} MiB`);

// A deterministic shuffle, so a run can be repeated.
function shuffled(n: number, seed: number): number[] {
  const a = Array.from({ length: n }, (_, i) => i);
  let s = seed;
  for (let i = n - 1; i > 0; i--) {
    s = (s * 1103515245 + 12345) & 0x7fffffff;
    const j = s % (i + 1);
    [a[i], a[j]] = [a[j], a[i]];
  }
  return a;
}

function worker(file: string, cfg: unknown) {
  return fork(path.join(__dirname, file), [JSON.stringify(cfg)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
}

/** Runs the demo (cli/demo.ts parses its options). */
export async function runDemo(o: DemoOptions): Promise<void> {
  checkDemoOptions(o);
  const regions = o.mla ? o.layers : o.layers * 2;
  const headBytes = o.mla ? o.blockKib * 1024 : (o.blockKib * 1024) / o.heads;
  const base = { heads: o.heads, headBytes, numBlocks: o.blocks, regions, mla: o.mla };
  const pSpec: Omit<KvSpec, 'tpRank'> = { ...base, tpSize: o.prefillTp };
  const dSpec = (r: number): KvSpec => ({ ...base, tpSize: o.decodeTp, tpRank: r });
  const hash = computeCompatibilityHash({
    vllmVersion: 'nixl-node-demo',
    model: 'demo-model',
    dtype: 'torch.bfloat16',
    numKvHeads: o.heads,
    headSize: 128,
    numHiddenLayers: o.layers,
    attnBackendName: o.mla ? 'FLASHMLA' : 'FLASH_ATTN',
    cacheDtype: 'auto',
    isHmaEnabled: false,
    transferMode: 'pull',
  });
  const pBlock = rankDims(pSpec).blockLen;
  const dBlock = rankDims({ ...base, tpSize: o.decodeTp }).blockLen;
  console.log(
    `nixl-node demo: prefill TP=${o.prefillTp} -> decode TP=${o.decodeTp}${o.mla ? ' (MLA)' : ''}, ${o.layers} layers x ${o.mla ? 'latent' : 'K/V'} x ${o.blocks} blocks`,
  );
  console.log(
    `  block per region: ${pBlock / 1024} KiB on a prefill rank, ${dBlock / 1024} KiB on a decode rank; ${fmt(rankBytes({ ...pSpec, tpRank: 0 }) * o.prefillTp)} of KV on the prefill side`,
  );
  console.log(
    `  engine ${o.engine}${o.engine === 'nixl' ? PROGRESS_TEXT[o.progressThread] : ''}, handshake over ${o.method}, ${o.requests} requests, ${o.inFlight} pulls in flight per decode rank`,
  );

  // Requests: the prefill allocated each prompt's blocks in a run; decode
  // allocates wherever it has free blocks. Each round reuses the prefill's
  // blocks (freed by the last round's reads) for new requests.
  const per = Math.floor(o.blocks / o.requests);
  const rounds: DemoRequest[][] = Array.from({ length: o.rounds }, (_, k) => {
    const localOrder = shuffled(o.blocks, 7 + k);
    return Array.from({ length: o.requests }, (_, q) => ({
      requestId: k === 0 ? `demo-req-${q}` : `demo-req-${q}-r${k}`,
      remote: Array.from({ length: per }, (_, i) => q * per + i),
      local: localOrder.slice(q * per, (q + 1) * per),
    }));
  });
  const requests = rounds.flat();

  const prefill = worker('prefill-worker.js', {
    spec: pSpec,
    method: o.method,
    engine: o.engine,
    progressThread: o.progressThread !== 'none',
    compatibilityHash: hash,
  } satisfies PrefillConfig);
  const failures: string[] = [];
  const ready = await new Promise<{ port: number; fillMs: number; engine: string }>((resolve, reject) => {
    prefill.once('message', (m) => resolve(m as { port: number; fillMs: number; engine: string }));
    prefill.once('exit', (c, sig) => reject(new Error(`prefill worker exited (${sig ?? c})`)));
  });
  console.log(
    `  prefill ready in ${ready.fillMs.toFixed(0)} ms (KV filled and registered), side channel on 127.0.0.1:${ready.port}`,
  );
  let released = 0;
  let expired = 0;
  const allReleased = new Promise<void>((resolve) => {
    prefill.on('message', (m: { type: string; reasons?: string[] }) => {
      if (m.type !== 'released') return;
      released++;
      if (m.reasons!.some((r) => r !== 'read')) expired++;
      if (released === requests.length) resolve();
    });
  });
  const expectRound = (k: number) => {
    for (const q of rounds[k]) prefill.send({ type: 'expect', requestId: q.requestId, blockIds: q.remote });
  };

  const totalBytes = o.decodeTp * requests.length * per * regions * dBlock;
  let moved = 0;
  let lastShown = 0;
  const tty = process.stdout.isTTY;
  const show = (force = false) => {
    const now = Date.now();
    if (!force && now - lastShown < (tty ? 100 : 1000)) return;
    lastShown = now;
    const line = `  pulled ${fmt(moved)} / ${fmt(totalBytes)} (${((100 * moved) / totalBytes).toFixed(0)}%)`;
    if (tty) process.stdout.write(`\r${line}`);
    else console.log(line);
  };
  let handshaken = 0;
  const decoders: ReturnType<typeof worker>[] = [];
  // A prefill that dies mid-run fails the demo at once (the decode ranks would
  // otherwise wait out their timeouts).
  // If the demo fails, its workers must not outlive it.
  process.once('exit', () => {
    for (const w of [prefill, ...decoders]) if (w.exitCode === null && w.signalCode === null) w.kill();
  });
  const prefillGone = new Promise<never>((_, reject) =>
    prefill.once('exit', (c, sig) => reject(new Error(`prefill worker exited (${sig ?? c})`))),
  );
  prefillGone.catch(() => {}); // it exits at the end, too
  const roundReports: RoundReport[][] = Array.from({ length: o.decodeTp }, () => []);
  const handshakeMs: number[] = [];
  await Promise.race([
    prefillGone,
    Promise.all(
      Array.from(
        { length: o.decodeTp },
        (_, r) =>
          new Promise<void>((resolve, reject) => {
            const w = worker('decode-worker.js', {
              spec: dSpec(r),
              prefillTp: o.prefillTp,
              port: ready.port,
              method: o.method,
              engine: o.engine,
              progressThread: o.progressThread === 'both',
              compatibilityHash: hash,
              rounds,
              inFlight: o.inFlight,
            } satisfies DecodeConfig);
            decoders.push(w);
            w.on('message', (m: { type: string; round?: number; bytes?: number; message?: string }) => {
              if (m.type === 'ready') {
                // every rank is ready for the round: its requests are expected, start them together
                if (++handshaken === o.decodeTp * (m.round! + 1)) {
                  expectRound(m.round!);
                  for (const d of decoders) d.send({ type: 'go' });
                }
                if (m.round === 0) handshakeMs[r] = (m as unknown as { handshakeMs: number }).handshakeMs;
              } else if (m.type === 'progress') {
                moved += m.bytes!;
                show();
              } else if (m.type === 'round') roundReports[r].push(m as unknown as RoundReport);
              else if (m.type === 'done') resolve();
              else if (m.type === 'error') reject(new Error(`decode rank ${r}: ${m.message}`));
            });
            w.once('exit', (c, sig) => c !== 0 && reject(new Error(`decode rank ${r} exited (${sig ?? c})`)));
          }),
      ),
    ),
  ]);
  show(true);
  if (tty) process.stdout.write('\n');
  const releasedInTime = await Promise.race([
    allReleased.then(() => true),
    new Promise<boolean>((r) => setTimeout(() => r(false), 10_000)),
  ]);
  prefill.send({ type: 'exit' });

  const all = roundReports.flat();
  const bytes = all.reduce((a, r) => a + r.bytes, 0);
  const bad = all.reduce((a, r) => a + r.bad, 0);
  const transport = o.engine === 'nixl' ? 'NIXL (UCX)' : 'loopback engine, shared-memory mapping (one host)';
  const rows: Array<[string, string]> = [
    ['engine / transport', transport],
    [
      'handshake',
      `${o.method}: ${Math.min(...handshakeMs).toFixed(1)}-${Math.max(...handshakeMs).toFixed(1)} ms per decode rank`,
    ],
    [
      'requests',
      `${o.rounds} round(s) x ${o.requests} x ${per} blocks, ${o.decodeTp} decode ranks, the same prefill blocks each round`,
    ],
    ['blocks moved', `${o.decodeTp * requests.length * per * regions} block slices of ${dBlock / 1024} KiB`],
    ['bytes moved', fmt(bytes)],
    ['descriptors', String(all.reduce((a, r) => a + r.descriptors, 0))],
    ['verified', bad === 0 ? `every byte (${fmt(bytes)}), after each round` : `${bad} head rows WRONG`],
    [
      'prefill freed',
      releasedInTime
        ? `${released}/${requests.length} requests after all decode reads${expired ? ` (${expired} expired)` : ''}`
        : `${released}/${requests.length} (timed out waiting)`,
    ],
  ];
  const native = o.engine === 'nixl' ? nativeBaseline(dBlock) : undefined;
  if (native) rows.push(['native NIXL', nativeLine(native)]);
  console.log('');
  const w = Math.max(...rows.map((r) => r[0].length));
  for (const [k, v] of rows) console.log(`  ${k.padEnd(w)}  ${v}`);
  const memcpy = memcpyGbps();
  const summaries = printBreakdown(roundReports, {
    handshakeMs,
    remoteRanks: (i) => targetRemoteRanks(o.decodeTp, i, o.prefillTp),
    memcpyGbps: memcpy,
  });
  if (bad) failures.push(`${bad} head rows WRONG`);
  if (!releasedInTime) failures.push(`the prefill freed ${released}/${requests.length} requests`);
  if (expired) failures.push(`${expired} requests expired`);
  if (o.json) {
    const later = summaries.slice(1).map((r) => r.gbps);
    writeDemoResult(o.json, {
      ok: failures.length === 0,
      failures,
      engine: o.engine,
      method: o.method,
      progressThread: o.progressThread,
      geometry: {
        prefillTp: o.prefillTp,
        decodeTp: o.decodeTp,
        layers: o.layers,
        regions,
        blocks: o.blocks,
        heads: o.heads,
        mla: o.mla,
        blockKib: o.blockKib,
        prefillBlockBytes: pBlock,
        decodeBlockBytes: dBlock,
        requests: o.requests,
        blocksPerRequest: per,
        inFlight: o.inFlight,
        rounds: o.rounds,
      },
      plan: rounds,
      handshakeMs,
      bytes,
      descriptors: all.reduce((a, r) => a + r.descriptors, 0),
      badRows: bad,
      released,
      expired,
      memcpyGbps: memcpy,
      rounds: summaries,
      firstGbps: summaries[0].gbps,
      laterGbps: later.length ? { median: median(later), min: Math.min(...later), max: Math.max(...later) } : null,
      native,
    } satisfies DemoResult);
  }
  if (failures.length) throw new Error(`demo FAILED: ${failures.join('; ')}`);
}

/** memcpy (one thread, 64 MiB, median of 5) in this run: what the demo's GB/s are held against. */
function memcpyGbps(): number {
  const n = 64 << 20;
  const a = Buffer.alloc(n, 1);
  const b = Buffer.alloc(n, 2);
  a.copy(b); // fault both in
  const xs: number[] = [];
  for (let i = 0; i < 5; i++) {
    const t = process.hrtime.bigint();
    a.copy(b);
    xs.push(n / Number(process.hrtime.bigint() - t));
  }
  return xs.sort((x, y) => x - y)[2];
}

/**
 * The same NIXL, from a C++ program (bench/native): one process pair reading
 * 64 MiB in blocks of the decode's size with scattered ids, as the demo's
 * shuffled decode blocks are: what this machine's NIXL does without Node.
 */
function nativeBaseline(block: number): NativeBaseline {
  try {
    const prog = nativeProgram();
    if ('skip' in prog) return { skip: prog.skip };
    const count = Math.min(4096, Math.floor((64 << 20) / block));
    const out = execFileSync(
      prog.path,
      ['--block', String(block), '--count', String(count), '--reps', '3', '--scatter'],
      {
        encoding: 'utf8',
        stdio: ['ignore', 'pipe', 'ignore'],
      },
    );
    const j = JSON.parse(out.trim().split('\n').at(-1)!);
    return { gbps: j.gbps, gbpsMin: j.gbpsMin, gbpsMax: j.gbpsMax, blockBytes: block, blocks: count };
  } catch (e) {
    return { error: (e as Error).message.split('\n')[0] };
  }
}

function nativeLine(n: NativeBaseline): string {
  if ('skip' in n) return `(baseline skipped: ${n.skip})`;
  if ('error' in n) return `(baseline failed: ${n.error})`;
  return `${n.gbps.toFixed(2)} GB/s (${n.gbpsMin.toFixed(2)}-${n.gbpsMax.toFixed(2)}): a C++ program on the same NIXL, one process pair, ${n.blocks} scattered ${n.blockBytes / 1024} KiB blocks`;
}
