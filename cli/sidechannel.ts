// nixl-node sidechannel fetch|serve: what an operator uses to debug a
// side-channel host. fetch asks one rank for its handshake payload and prints
// it (--json: every field, agent metadata as hex, addresses as decimal
// strings); serve answers with synthetic metadata until killed. Speaks the
// wire profile this version implements, vLLM v0.13 (NixlConnector version 2).
import { createHandshake, type HandshakeMethod } from '../lib/handshake';
import { encodeAgentMetadata, type HandshakePayload } from '../lib/handshake/codec';
import { oneOf, parse, positiveInt, UsageError } from './args';

const WIRES = ['v0.13', 'v12'] as const;

const FETCH_HELP = `nixl-node sidechannel fetch: ask a side channel for one rank's handshake payload

Usage: nixl-node sidechannel fetch --host H --port P --tp-rank R [options]
  --host H            side-channel host (default 127.0.0.1)
  --port P            its advertised base port
  --tp-rank R         tensor-parallel rank to ask for (default 0)
  --dp-rank D         data-parallel rank (default 0)
  --wire W            v0.13 (v12: not implemented by this version)
  --method M          zmq | http (default zmq)
  --expect-hash HEX   compare the compatibility hash; a mismatch exits non-zero
  --timeout-ms N      per attempt (default 5000)
  --json              one JSON object: every field, addresses as decimal strings
`;

const SERVE_HELP = `nixl-node sidechannel serve: answer handshakes with synthetic metadata until killed

Usage: nixl-node sidechannel serve --port P --tp-size N --synthetic [options]
  --host H            interface to bind (default 127.0.0.1)
  --port P            base port (0: any free port, printed)
  --tp-size N         ranks 0..N-1 are served
  --dp-rank D         data-parallel rank (default 0)
  --wire W            v0.13 (v12: not implemented by this version)
  --method M          zmq | http (default zmq)
  --hash HEX          compatibility hash to advertise (default 'synthetic')
  --synthetic         required: the metadata is made up (no memory behind it)
`;

function wire(v: Record<string, unknown>): void {
  const w = oneOf(v, 'wire', WIRES, 'v0.13');
  if (w !== 'v0.13') throw new UsageError(`--wire ${w}: this version speaks vLLM v0.13's format only`);
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
      'dp-rank': { type: 'string' },
      wire: { type: 'string' },
      method: { type: 'string' },
      'expect-hash': { type: 'string' },
      'timeout-ms': { type: 'string' },
      json: { type: 'boolean' },
    },
    FETCH_HELP,
  );
  wire(v);
  const method = oneOf(v, 'method', ['zmq', 'http'] as const, 'zmq') as HandshakeMethod;
  const hs = createHandshake(method, { keepAlive: false });
  try {
    const r = await hs.fetch({
      host: String(v.host ?? '127.0.0.1'),
      port: port(v, false),
      tpRank: rank(v, 'tp-rank'),
      dpRank: rank(v, 'dp-rank'),
      timeoutMs: positiveInt(v, 'timeout-ms', 5000, 600_000),
      retries: 0,
    });
    const expected = v['expect-hash'] as string | undefined;
    const verdict = expected === undefined ? 'unchecked' : expected === r.compatibilityHash ? 'match' : 'mismatch';
    const m = r.metadata;
    if (v.json) {
      console.log(
        JSON.stringify({
          wire: 'v0.13',
          method,
          rttMs: Number(r.rttMs.toFixed(3)),
          compatibilityHash: r.compatibilityHash,
          hashVerdict: verdict,
          engineId: m.engineId,
          agentMetadata: m.agentMetadata.toString('hex'),
          kvCachesBaseAddr: m.kvCachesBaseAddr.map(String),
          deviceId: m.deviceId,
          numBlocks: m.numBlocks,
          blockLens: m.blockLens,
          kvCacheLayout: m.kvCacheLayout,
          blockSize: m.blockSize,
        }),
      );
    } else {
      const rows: Array<[string, string]> = [
        ['rtt', `${r.rttMs.toFixed(2)} ms (${method}, wire v0.13)`],
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
      ];
      const w = Math.max(...rows.map((x) => x[0].length));
      for (const [k, x] of rows) console.log(`${k.padEnd(w)}  ${x}`);
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
function syntheticPayload(tpRank: number, hash: string): HandshakePayload {
  const regions = 4;
  return {
    compatibilityHash: hash,
    agentMetadataBytes: encodeAgentMetadata({
      engineId: 'synthetic',
      agentMetadata: Buffer.from(`synthetic agent metadata, tp rank ${tpRank}`),
      kvCachesBaseAddr: Array.from(
        { length: regions },
        (_, i) => 0x7f0000000000n + BigInt(tpRank) * (1n << 32n) + BigInt(i << 24),
      ),
      deviceId: 0,
      numBlocks: 1024,
      blockLens: Array(regions).fill(16384),
      kvCacheLayout: 'HND',
      blockSize: 16,
    }),
  };
}

export async function serveCommand(argv: string[]): Promise<void> {
  const v = parse(
    argv,
    {
      host: { type: 'string' },
      port: { type: 'string' },
      'tp-size': { type: 'string' },
      'dp-rank': { type: 'string' },
      wire: { type: 'string' },
      method: { type: 'string' },
      hash: { type: 'string' },
      synthetic: { type: 'boolean' },
    },
    SERVE_HELP,
  );
  wire(v);
  if (!v.synthetic) throw new UsageError('--synthetic is required: this command serves made-up metadata only');
  if (v['tp-size'] === undefined) throw new UsageError('--tp-size is required');
  const tpSize = positiveInt(v, 'tp-size', 1, 4096);
  const method = oneOf(v, 'method', ['zmq', 'http'] as const, 'zmq') as HandshakeMethod;
  const hash = String(v.hash ?? 'synthetic');
  const payloads = new Map(Array.from({ length: tpSize }, (_, r) => [r, syntheticPayload(r, hash)] as const));
  const hs = createHandshake(method);
  const server = await hs.serve({
    host: v.host as string | undefined,
    port: port(v, true),
    dpRank: rank(v, 'dp-rank'),
    payloads,
  });
  console.log(
    `serving synthetic metadata of tp ranks 0..${tpSize - 1} on ${server.host}:${server.basePort} (${method}, wire v0.13); Ctrl-C stops`,
  );
  await new Promise<void>((resolve) => {
    for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => resolve());
  });
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
