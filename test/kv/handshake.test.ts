// Real sockets on 127.0.0.1: both methods, TLS with a throwaway CA, timeouts,
// dead peers and garbage input.
import * as net from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import {
  type HandshakeServer,
  HTTP_SCHEMA,
  HttpHandshake,
  type WireName,
  createHandshake,
  decodeAgentMetadata,
  encodeAgentMetadata,
  wireProfile,
  zmqHandshake,
  type AgentMetadataInput,
  type HandshakePayload,
  type NixlAgentMetadata,
} from '../../lib/handshake';
import { GET_META_MSG, decodeHandshakePayload } from '../../lib/handshake/payload';
import { packMsgpack, unpackMsgpack } from '../../lib/handshake/msgpack';
import { encodeMetaRequest, openHandshakePayload, readReply } from '../../lib/handshake/wire';
import { makeCerts, type Certs } from '../../bench/certs';
import { Peer, freePort, onFreePort } from '../helpers';

const HASH = 'a'.repeat(64);

function input(rank: number, pp = 0): AgentMetadataInput {
  return {
    engineId: 'engine-P',
    agentMetadata: Buffer.from(`md-${pp}-${rank}`),
    kvCachesBaseAddr: [0x7f3a00000000n + BigInt(rank), 1n << 60n, 0xffff_ffff_ffff_f000n],
    deviceId: rank,
    numBlocks: 1000,
    blockLens: [32768, 32768, 32768],
    kvCacheLayout: 'LBHNC',
    blockSize: 16,
    attnBackendName: 'FLASH_ATTN',
  };
}

/** The model a decoder of this profile gives back. */
function meta(rank: number, wire: WireName, pp = 0): NixlAgentMetadata {
  return decodeAgentMetadata(encodeAgentMetadata(input(rank, pp), wire), wire);
}

function payloads(n: number, wire: WireName): Map<number, HandshakePayload> {
  return new Map(
    Array.from({ length: n }, (_, r) => [
      r,
      { compatibilityHash: HASH, agentMetadataBytes: encodeAgentMetadata(input(r), wire) },
    ]),
  );
}

function quietLogger() {
  const lines: string[] = [];
  return { lines, warn: (m: string) => void lines.push(m) };
}

describe.each(['v12', 'v0.13'] as const)('ZMQ side channel, wire %s', (wire) => {
  let server: HandshakeServer;
  const log = quietLogger();
  const other: WireName = wire === 'v12' ? 'v0.13' : 'v12';
  beforeAll(async () => {
    server = await zmqHandshake.serve({ port: 0, payloads: payloads(4, wire), logger: log, wire });
  });
  afterAll(() => server.close());

  it('binds 127.0.0.1 by default and serves each tp_rank', async () => {
    expect(server.host).toBe('127.0.0.1');
    for (const r of [0, 3]) {
      const got = await zmqHandshake.fetch({
        host: '127.0.0.1',
        port: server.basePort,
        tpRank: r,
        expectedHash: HASH,
        wire,
      });
      expect(got.metadata).toEqual(meta(r, wire));
      expect(got.compatibilityHash).toBe(HASH);
      expect(got.wire).toBe(wire);
      if (wire === 'v12') {
        // Same clock on both ends here: the offset is within the round trip.
        expect(Math.abs(got.clockOffsetS!)).toBeLessThan(got.rttMs / 1000 + 0.001);
      } else expect(got.clockOffsetS).toBeUndefined();
    }
  });

  it('a hash mismatch is NIXL_ERR_MISMATCH, a missing rank an error that names it', async () => {
    await expect(
      zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 0, expectedHash: 'b'.repeat(64), wire }),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_MISMATCH' });
    await expect(zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 9, wire })).rejects.toThrow(
      wire === 'v12' ? /no metadata for \(pp_rank 0, tp_rank 9\)/ : /no metadata for tp_rank 9/,
    );
  });

  it(`a ${other} client gets an error that names the mismatch, and the listener stays up`, async () => {
    await expect(
      zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 1, wire: other, retries: 0 }),
    ).rejects.toMatchObject({
      code: 'NIXL_ERR_MISMATCH',
      message: expect.stringMatching(new RegExp(`peer speaks ${wire.replace('.', '\\.')}`)),
    });
    const ok = await zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 1, wire });
    expect(ok.metadata.deviceId).toBe(1);
  });

  it('answers its request forms on the wire', async () => {
    const req = new zmq.Request({ linger: 0, receiveTimeout: 2000 });
    req.connect(`tcp://127.0.0.1:${server.port}`);
    await req.send(encodeMetaRequest(2, 0, wire));
    const frames = await req.receive();
    expect(frames).toHaveLength(wire === 'v12' ? 2 : 1);
    const { payload } = readReply(frames, wireProfile(wire));
    expect(openHandshakePayload(decodeHandshakePayload(payload), HASH, wire)).toEqual(meta(2, wire));
    if (wire === 'v0.13') {
      await req.send(GET_META_MSG);
      expect(openHandshakePayload(decodeHandshakePayload((await req.receive())[0]), HASH, wire)).toEqual(meta(0, wire));
    } else {
      expect(typeof unpackMsgpack(frames[1], 'ts')).toBe('object'); // a Float64
    }
    req.close();
  });

  it('garbage frames get an error answer and never kill the listener', async () => {
    const d = new zmq.Dealer({ linger: 0, receiveTimeout: 2000 });
    d.connect(`tcp://127.0.0.1:${server.port}`);
    const before = server.stats.refused;
    const junks = [
      Buffer.from([0xc1, 0xff]),
      Buffer.from('hello'),
      packMsgpack([Buffer.from('get_meta_msg'), 'x']),
      packMsgpack([Buffer.from('get_meta_msg'), 'x', 0]),
      packMsgpack(new Map([['a', 1]])),
      Buffer.from([0x93, 0xc4]),
      encodeMetaRequest(1, 0, other),
    ];
    for (const junk of junks) {
      await d.send(junk);
      const reply = await d.receive();
      expect(reply).toHaveLength(wire === 'v12' ? 2 : 1);
      expect(() => decodeHandshakePayload(reply[0])).toThrow(/peer answered with an error/);
    }
    await d.send([Buffer.from('a'), Buffer.from('b'), Buffer.from('c')]); // wrong frame count
    expect(decodeHandshakePayload.bind(null, (await d.receive())[0])).toThrow(/error/);
    d.close();
    // an over-size request: zmq drops that peer; nothing to answer
    const big = new zmq.Dealer({ linger: 0 });
    big.connect(`tcp://127.0.0.1:${server.port}`);
    await big.send(Buffer.alloc(100_000));
    big.close();
    expect(server.stats.refused).toBeGreaterThanOrEqual(before + junks.length + 1);
    expect(log.lines.length).toBeGreaterThan(0);
    const ok = await zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 1, wire });
    expect(ok.metadata.deviceId).toBe(1);
  });

  if (wire === 'v12')
    it('serves every (pp_rank, tp_rank) from one port', async () => {
      const list = [];
      for (let pp = 0; pp < 2; pp++)
        for (let tp = 0; tp < 2; tp++)
          list.push({
            ppRank: pp,
            tpRank: tp,
            payload: { compatibilityHash: HASH, agentMetadataBytes: encodeAgentMetadata(input(tp, pp), wire) },
          });
      const s = await zmqHandshake.serve({ port: 0, payloads: list, logger: log, wire });
      try {
        const got = await zmqHandshake.fetch({ host: '127.0.0.1', port: s.basePort, ppRank: 1, tpRank: 1, wire });
        expect(got.metadata.agentMetadata.toString()).toBe('md-1-1');
        await expect(
          zmqHandshake.fetch({ host: '127.0.0.1', port: s.basePort, ppRank: 2, tpRank: 0, wire }),
        ).rejects.toThrow(/no metadata for \(pp_rank 2, tp_rank 0\) \(serving \(0:0\), \(0:1\), \(1:0\), \(1:1\)\)/);
      } finally {
        await s.close();
      }
    });

  it('data-parallel ranks listen on port + dp_rank', async () => {
    // It binds base + 1: a port nobody checked, so retry when it is taken.
    let base = 0;
    const s = await onFreePort((p) => {
      base = p;
      return zmqHandshake.serve({ port: p, dpRank: 1, payloads: payloads(1, wire), logger: log, wire });
    });
    try {
      expect(s.port).toBe(base + 1);
      const got = await zmqHandshake.fetch({ host: '127.0.0.1', port: base, dpRank: 1, tpRank: 0, wire });
      expect(got.metadata.engineId).toBe('engine-P');
    } finally {
      await s.close();
    }
  });

  it('a dead peer and a silent peer time out with NIXL_ERR_TIMEOUT after the retries', async () => {
    const dead = await freePort();
    const t0 = Date.now();
    await expect(
      zmqHandshake.fetch({ host: '127.0.0.1', port: dead, tpRank: 0, timeoutMs: 150, retries: 1 }),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
    expect(Date.now() - t0).toBeGreaterThanOrEqual(290);
    const silent = new zmq.Router({ linger: 0 });
    await silent.bind('tcp://127.0.0.1:*');
    const port = Number(/:(\d+)$/.exec(silent.lastEndpoint!)![1]);
    await expect(
      zmqHandshake.fetch({ host: '127.0.0.1', port, tpRank: 0, timeoutMs: 150, retries: 0 }),
    ).rejects.toThrow(/no answer/);
    silent.close();
  });
});

describe('HTTP/S side channel', () => {
  let certs: Certs;
  beforeAll(() => {
    certs = makeCerts();
  });

  it.each(['v12', 'v0.13'] as const)(
    'serves JSON (schema %s) by dp/tp rank with 404s that say what is missing',
    async (wire) => {
      const h = new HttpHandshake();
      const s = await h.serve({ port: 0, dpRank: 0, payloads: payloads(2, wire), logger: quietLogger(), wire });
      try {
        expect(s.host).toBe('127.0.0.1');
        const got = await h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 1, expectedHash: HASH, wire });
        expect(got.metadata).toEqual(meta(1, wire)); // 2^60 and 2^64-4096 survived JSON as decimal strings
        expect(got.clockOffsetS === undefined).toBe(wire === 'v0.13');
        const all = await (await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata`)).json();
        expect(all).toMatchObject({ schema: HTTP_SCHEMA, wire, dp_rank: 0 });
        expect(all.ranks.map((r: { tp_rank: number }) => r.tp_rank)).toEqual([0, 1]);
        expect(all.ranks[1].agent_metadata.agent_metadata).toBe(Buffer.from('md-0-1').toString('base64'));
        expect(all.ranks[1].agent_metadata.kv_caches_base_addr).toEqual([
          0x7f3a00000001,
          '1152921504606846976',
          '18446744073709547520',
        ]);
        expect(Object.keys(all.ranks[1].agent_metadata)).toHaveLength(wire === 'v12' ? 19 : 8);
        const r404 = await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata/0/7`);
        expect(r404.status).toBe(404);
        expect((await r404.json()).detail).toMatch(/no metadata for \(pp_rank 0, tp_rank 7\)/);
        expect((await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata/0/0?pp_rank=x`)).status).toBe(400);
        await expect(
          h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0, wire: wire === 'v12' ? 'v0.13' : 'v12' }),
        ).rejects.toThrow(new RegExp(`speaks ${wire.replace('.', '\\.')}, this client`));
        await expect(h.fetch({ host: '127.0.0.1', port: s.port, dpRank: 3, tpRank: 0, wire })).rejects.toThrow(
          /dp_rank 3 is not served/,
        );
        await expect(
          h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0, expectedHash: 'c'.repeat(64), wire }),
        ).rejects.toMatchObject({ code: 'NIXL_ERR_MISMATCH' });
        expect((await fetch(`http://127.0.0.1:${s.port}/other`)).status).toBe(404);
        expect(
          (await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata/0`, { method: 'POST', body: 'x' })).status,
        ).toBe(405);
      } finally {
        h.close();
        await s.close();
      }
    },
  );

  it('TLS with a self-signed CA, a client-certificate check and a bearer token', async () => {
    const h = new HttpHandshake();
    const s = await h.serve({
      port: 0,
      payloads: payloads(1, 'v12'),
      logger: quietLogger(),
      bearerToken: 'sekret',
      tls: { cert: certs.serverCert, key: certs.serverKey, clientCa: certs.ca },
    });
    try {
      const base = { host: '127.0.0.1', port: s.port, tpRank: 0, retries: 0, timeoutMs: 2000 };
      const good = { ca: certs.ca, cert: certs.clientCert, key: certs.clientKey };
      const got = await h.fetch({ ...base, tls: good, bearerToken: 'sekret' });
      expect(got.metadata).toEqual(meta(0, 'v12'));
      await expect(h.fetch({ ...base, tls: good, bearerToken: 'wrong' })).rejects.toThrow(/HTTP 401/);
      await expect(h.fetch({ ...base, tls: { ca: certs.ca }, bearerToken: 'sekret' })).rejects.toThrow(); // no client cert
      await expect(h.fetch({ ...base, tls: { ...good, ca: certs.otherCa }, bearerToken: 'sekret' })).rejects.toThrow(
        /certificate/,
      );
      await expect(h.fetch({ ...base, bearerToken: 'sekret' })).rejects.toThrow(); // plain HTTP to a TLS port
    } finally {
      h.close();
      await s.close();
    }
  });

  it('an answer over maxResponseBytes is refused, naming the limit, and not retried', async () => {
    const h = new HttpHandshake();
    const s = await h.serve({ port: 0, payloads: payloads(1, 'v12'), logger: quietLogger() });
    try {
      await expect(
        h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0, maxResponseBytes: 64, timeoutMs: 5000 }),
      ).rejects.toMatchObject({
        code: 'NIXL_ERR_INVALID_PARAM',
        message: expect.stringMatching(/larger than 64 bytes/),
      });
      expect(s.stats.served).toBe(1);
    } finally {
      h.close();
      await s.close();
    }
  });

  it('garbage on the socket gets a 400, the server lives on; dead and silent peers time out', async () => {
    const h = new HttpHandshake();
    const log = quietLogger();
    const s = await h.serve({ port: 0, payloads: payloads(1, 'v12'), logger: log });
    try {
      for (const junk of ['\x00\x01\x02garbage\r\n\r\n', `GET /${'x'.repeat(20000)} HTTP/1.1\r\n\r\n`]) {
        // Each step bounded with its own message: this test timed out at 30 s twice in many runs, step unknown.
        const answer = await new Promise<string>((resolve, reject) => {
          const c = net.connect(s.port, '127.0.0.1', () => c.write(junk));
          let out = '';
          const t = setTimeout(() => {
            c.destroy();
            reject(
              new Error(`junk ${JSON.stringify(junk.slice(0, 12))}: no close in 8 s; read ${JSON.stringify(out)}`),
            );
          }, 8000);
          c.on('data', (d) => (out += d));
          c.on('close', () => {
            clearTimeout(t);
            resolve(out);
          });
          c.on('error', () => {});
        });
        expect(answer).toMatch(/^HTTP\/1.1 4\d\d/);
      }
      expect(log.lines.length).toBeGreaterThan(0);
      expect((await h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0 })).metadata.deviceId).toBe(0);
      const dead = await freePort();
      await expect(
        h.fetch({ host: '127.0.0.1', port: dead, tpRank: 0, retries: 1, timeoutMs: 200 }),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_TIMEOUT' });
      const silent = net.createServer(() => {});
      await new Promise<void>((r) => silent.listen(0, '127.0.0.1', () => r()));
      const t0 = Date.now();
      await expect(
        h.fetch({
          host: '127.0.0.1',
          port: (silent.address() as net.AddressInfo).port,
          tpRank: 0,
          retries: 0,
          timeoutMs: 200,
        }),
      ).rejects.toThrow(/no answer within 200 ms/);
      expect(Date.now() - t0).toBeLessThan(5000);
      silent.close();
    } finally {
      h.close();
      await Promise.race([
        s.close(),
        new Promise((_, reject) =>
          setTimeout(() => reject(new Error('the server did not close in 8 s')), 8000).unref(),
        ),
      ]);
    }
  });
});

describe.each(['zmq', 'http'] as const)('prefill process serving over %s', (method) => {
  it('a decode process (this one) fetches every rank', async () => {
    const peer = new Peer('prefill-handshake.js', [method, '2']);
    try {
      const { port } = await peer.next<{ port: number }>();
      const hs = createHandshake(method);
      for (const r of [0, 1]) {
        const got = await hs.fetch({ host: '127.0.0.1', port, tpRank: r, expectedHash: 'h'.repeat(64) });
        expect(got.metadata.agentMetadata.toString()).toBe(`agent-md-of-rank-${r}`);
        expect(got.metadata.kvCachesBaseAddr[0]).toBe(0x7f0000000000n + BigInt(r) * 0x100000000n);
      }
      hs.close();
    } finally {
      peer.send('exit');
      await peer.exit();
    }
  });
});

it('NIXL_HANDSHAKE_METHOD picks the strategy', () => {
  const old = process.env.NIXL_HANDSHAKE_METHOD;
  try {
    process.env.NIXL_HANDSHAKE_METHOD = 'http';
    expect(createHandshake().method).toBe('http');
    delete process.env.NIXL_HANDSHAKE_METHOD;
    expect(createHandshake().method).toBe('zmq');
    expect(() => createHandshake('smoke' as 'zmq')).toThrow(/expected 'zmq' or 'http'/);
  } finally {
    if (old === undefined) delete process.env.NIXL_HANDSHAKE_METHOD;
    else process.env.NIXL_HANDSHAKE_METHOD = old;
  }
});
