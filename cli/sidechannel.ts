// nixl-node sidechannel fetch|serve: what an operator uses to debug a
// side-channel host. fetch asks one rank for its handshake payload and prints
// it (--json: every field, agent metadata as hex, addresses as decimal
// strings, v12 clock offset); serve answers with synthetic metadata until
// killed. Both wire profiles: --wire v12 (default, or NIXL_WIRE) or v0.13.
import { createHandshake, type HandshakeMethod } from '../lib/handshake';
import type { HandshakePayload } from '../lib/handshake/payload';
import type { WireName } from '../lib/handshake/model';
import { encodeAgentMetadata, wireProfile } from '../lib/handshake/wire';
import { oneOf, parse, positiveInt, UsageError, untilSignal } from './args';

const WIRES = ['v12', 'v0.13'] as const;

const FETCH_HELP = `nixl-node sidechannel fetch: ask a side channel for one rank's handshake payload

Usage: nixl-node sidechannel fetch --host H --port P --tp-rank R [options]
  --host H            side-channel host (default 127.0.0.1)
  --port P            its advertised base port
  --tp-rank R         tensor-parallel rank to ask for (default 0)
  --pp-rank Q         pipeline-parallel rank (v12; default 0)
  --dp-rank D         data-parallel rank (default 0)
  --wire W            v12 | v0.13 (default: NIXL_WIRE, else v12)
  --method M          zmq | http (default zmq)
  --expect-hash HEX   compare the compatibility hash; a mismatch exits non-zero
  --timeout-ms N      per attempt (default 5000)
  --json              one JSON object: every field, addresses as decimal strings,
                      agent metadata as hex, RTT, v12 clock offset, hash verdict
Exits non-zero with the error's code on any failure.
`;

const SERVE_HELP = `nixl-node sidechannel serve: answer handshakes with synthetic metadata until killed

Usage: nixl-node sidechannel serve --port P --tp-size N --synthetic [options]
  --host H            interface to bind (default 127.0.0.1)
  --port P            base port (0: any free port, printed)
  --tp-size N         ranks 0..N-1 are served
  --pp-size M         pipeline ranks 0..M-1 are served (v12; default 1)
  --dp-rank D         data-parallel rank (default 0)
  --wire W            v12 | v0.13 (default: NIXL_WIRE, else v12)
  --method M          zmq | http (default zmq)
  --hash HEX          compatibility hash to advertise (default 'synthetic')
  --synthetic         required: the metadata is made up (no memory behind it)
`;

function wire(v: Record<string, unknown>): WireName {
  if (v.wire === undefined && process.env.NIXL_WIRE !== undefined) {
    try {
      return wireProfile().name;
    } catch (e) {
      throw new UsageError((e as Error).message);
    }
  }
  return oneOf(v, 'wire', WIRES, 'v12') as WireName;
}

function port(v: Record<string, unknown>, allowZero: boolean): number {
  const s = v.port;
  if (s === undefined) throw new UsageError('--port is required');
  const n = Number(s);
  if (!/^\d+$/.test(String(s)) || n > 65535 || (!allowZero && n === 0))
    throw new UsageError(`--port must be a port number, got '${String(s)}'`);
  return n;
}

function rank(v: Record<string, unknown>, name: string): number {
  const s = v[name];
  if (s === undefined) return 0;
  if (!/^\d+$/.test(String(s)) || Number(s) > 65535)
    throw new UsageError(`--${name} must be an integer from 0 to 65535, got '${String(s)}'`);
  return Number(s);
}

export async function fetchCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    {
      host: { type: 'string' },
      port: { type: 'string' },
      'tp-rank': { type: 'string' },
      'pp-rank': { type: 'string' },
      'dp-rank': { type: 'string' },
      wire: { type: 'string' },
      method: { type: 'string' },
      'expect-hash': { type: 'string' },
      'timeout-ms': { type: 'string' },
      json: { type: 'boolean' },
    },
    FETCH_HELP,
  );
  const w = wire(v);
  const ppRank = rank(v, 'pp-rank');
  if (ppRank !== 0 && w === 'v0.13') throw new UsageError('--pp-rank: the v0.13 format has no pipeline ranks');
  const method = oneOf(v, 'method', ['zmq', 'http'] as const, 'zmq') as HandshakeMethod;
  const hs = createHandshake(method, { keepAlive: false });
  try {
    const r = await hs.fetch({
      host: String(v.host ?? '127.0.0.1'),
      port: port(v, false),
      tpRank: rank(v, 'tp-rank'),
      ppRank,
      dpRank: rank(v, 'dp-rank'),
      wire: w,
      timeoutMs: positiveInt(v, 'timeout-ms', 5000, 600_000),
      retries: 0,
    });
    const expected = v['expect-hash'] as string | undefined;
    const verdict = expected === undefined ? 'unchecked' : expected === r.compatibilityHash ? 'match' : 'mismatch';
    const m = r.metadata;
    if (v.json) {
      console.log(
        JSON.stringify({
          wire: w,
          nixlConnectorVersion: wireProfile(w).connectorVersion,
          method,
          ppRank,
          tpRank: rank(v, 'tp-rank'),
          rttMs: Number(r.rttMs.toFixed(3)),
          remoteClockS: r.remoteSeconds ?? null,
          clockOffsetS: r.clockOffsetS ?? null,
          compatibilityHash: r.compatibilityHash,
          hashVerdict: verdict,
          ...m,
          agentMetadata: m.agentMetadata.toString('hex'),
          kvCachesBaseAddr: m.kvCachesBaseAddr.map(String),
        }),
      );
    } else {
      const rows: Array<[string, string]> = [
        ['rtt', `${r.rttMs.toFixed(2)} ms (${method}, wire ${w})`],
        ...(r.clockOffsetS === undefined
          ? []
          : [['clock offset', `${(r.clockOffsetS * 1000).toFixed(3)} ms (remote - local)`] as [string, string]]),
        ['compatibility hash', `${r.compatibilityHash} (${verdict})`],
        ['engine id', m.engineId],
        ['agent metadata', `${m.agentMetadata.length} bytes`],
        [
          'regions',
          `${m.kvCachesBaseAddr.length}: ${m.kvCachesBaseAddr
            .slice(0, 4)
            .map((a) => `0x${a.toString(16)}`)
            .join(', ')}${m.kvCachesBaseAddr.length > 4 ? ', ...' : ''}`,
        ],
        ['block lens', [...new Set(m.blockLens)].join(', ')],
        ['blocks', `${m.numBlocks} of ${m.blockSize} tokens, layout ${m.kvCacheLayout}, device ${m.deviceId}`],
        ['block strides', [...new Set(m.blockStrides)].join(', ')],
        ...(w === 'v0.13'
          ? []
          : ([
              ['attention', `${m.attnBackendName}, ${m.physicalBlocksPerLogical} kernel block(s) per logical block`],
              ['parallel', `dcp ${m.dcpSize}, pcp ${m.pcpSize}`],
            ] as Array<[string, string]>)),
      ];
      const width = Math.max(...rows.map((x) => x[0].length));
      for (const [k, x] of rows) console.log(`${k.padEnd(width)}  ${x}`);
    }
    if (verdict === 'mismatch') {
      throw Object.assign(
        new Error(`compatibility hash mismatch: remote ${r.compatibilityHash}, expected ${expected}`),
        {
          code: 'NIXL_ERR_MISMATCH',
        },
      );
    }
  } finally {
    hs.close();
  }
}

/** Metadata with no memory behind it, the same for every run. */
function syntheticPayload(ppRank: number, tpRank: number, hash: string, w: WireName): HandshakePayload {
  const regions = 4;
  return {
    compatibilityHash: hash,
    agentMetadataBytes: encodeAgentMetadata(
      {
        engineId: 'synthetic',
        agentMetadata: Buffer.from(`synthetic agent metadata, tp rank ${tpRank}`),
        kvCachesBaseAddr: Array.from(
          { length: regions },
          (_, i) => 0x7f0000000000n + BigInt(ppRank) * (1n << 40n) + BigInt(tpRank) * (1n << 32n) + BigInt(i << 24),
        ),
        deviceId: 0,
        numBlocks: 1024,
        blockLens: Array(regions).fill(16384),
        kvCacheLayout: 'LBHNC',
        blockSize: 16,
        attnBackendName: 'FLASH_ATTN',
      },
      w,
    ),
  };
}

export async function serveCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    {
      host: { type: 'string' },
      port: { type: 'string' },
      'tp-size': { type: 'string' },
      'pp-size': { type: 'string' },
      'dp-rank': { type: 'string' },
      wire: { type: 'string' },
      method: { type: 'string' },
      hash: { type: 'string' },
      synthetic: { type: 'boolean' },
    },
    SERVE_HELP,
  );
  const w = wire(v);
  if (!v.synthetic) throw new UsageError('--synthetic is required: this command serves made-up metadata only');
  if (v['tp-size'] === undefined) throw new UsageError('--tp-size is required');
  const tpSize = positiveInt(v, 'tp-size', 1, 4096);
  const ppSize = positiveInt(v, 'pp-size', 1, 4096);
  if (ppSize > 1 && w === 'v0.13') throw new UsageError('--pp-size: the v0.13 format has no pipeline ranks');
  const method = oneOf(v, 'method', ['zmq', 'http'] as const, 'zmq') as HandshakeMethod;
  const hash = String(v.hash ?? 'synthetic');
  const payloads = [];
  for (let pp = 0; pp < ppSize; pp++)
    for (let tp = 0; tp < tpSize; tp++)
      payloads.push({ ppRank: pp, tpRank: tp, payload: syntheticPayload(pp, tp, hash, w) });
  const hs = createHandshake(method);
  const server = await hs.serve({
    host: v.host as string | undefined,
    port: port(v, true),
    dpRank: rank(v, 'dp-rank'),
    payloads,
    wire: w,
  });
  const stop = untilSignal(); // before the line that says it serves: a script may signal the moment it reads it
  console.log(
    `serving synthetic metadata of ${ppSize > 1 ? `pp ranks 0..${ppSize - 1} x ` : ''}tp ranks 0..${tpSize - 1} on ${server.host}:${server.basePort} (${method}, wire ${w}); Ctrl-C stops`,
  );
  await stop;
  await server.close();
  hs.close();
  console.log(`served ${server.stats.served}, refused ${server.stats.refused}`);
}

export async function sidechannel(argv: string[]): Promise<void> {
  const [sub, ...rest] = argv;
  if (sub === 'fetch') return fetchCommand(rest);
  if (sub === 'serve') return serveCommand(rest);
  if (sub === '--help' || sub === '-h' || sub === undefined) {
    process.stdout.write(
      `Usage: nixl-node sidechannel fetch|serve [options] (--help on each)\n\n${FETCH_HELP}\n${SERVE_HELP}`,
    );
    return;
  }
  throw new UsageError(`unknown sidechannel command '${sub}' (fetch or serve)`);
}
