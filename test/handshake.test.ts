// Real sockets on 127.0.0.1: both methods, TLS with a throwaway CA, timeouts,
// dead peers and garbage input.
import * as net from 'node:net';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import * as zmq from 'zeromq';
import {
  GET_META_MSG,
  type HandshakeServer,
  HttpHandshake,
  createHandshake,
  decodeHandshakePayload,
  encodeAgentMetadata,
  encodeMetaRequest,
  openHandshakePayload,
  packMsgpack,
  zmqHandshake,
  type HandshakePayload,
  type NixlAgentMetadata,
} from '../lib/handshake';
import { makeCerts, type Certs } from '../bench/certs';
import { Peer, freePort } from './helpers';

const HASH = 'a'.repeat(64);

function meta(rank: number): NixlAgentMetadata {
  return {
    engineId: 'engine-P',
    agentMetadata: Buffer.from(`md-${rank}`),
    kvCachesBaseAddr: [0x7f3a00000000n + BigInt(rank), 1n << 60n],
    deviceId: rank,
    numBlocks: 1000,
    blockLens: [32768, 32768],
    kvCacheLayout: 'HND',
    blockSize: 16,
  };
}

function payloads(n: number): Map<number, HandshakePayload> {
  return new Map(
    Array.from({ length: n }, (_, r) => [
      r,
      { compatibilityHash: HASH, agentMetadataBytes: encodeAgentMetadata(meta(r)) },
    ]),
  );
}

function quietLogger() {
  const lines: string[] = [];
  return { lines, warn: (m: string) => void lines.push(m) };
}

describe('ZMQ side channel', () => {
  let server: HandshakeServer;
  const log = quietLogger();
  beforeAll(async () => {
    server = await zmqHandshake.serve({ port: 0, payloads: payloads(4), logger: log });
  });
  afterAll(() => server.close());

  it('binds 127.0.0.1 by default and serves each tp_rank', async () => {
    expect(server.host).toBe('127.0.0.1');
    for (const r of [0, 3]) {
      const got = await zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: r, expectedHash: HASH });
      expect(got.metadata).toEqual(meta(r));
      expect(got.compatibilityHash).toBe(HASH);
    }
  });

  it('a hash mismatch is NIXL_ERR_MISMATCH, a missing rank an error frame', async () => {
    await expect(
      zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 0, expectedHash: 'b'.repeat(64) }),
    ).rejects.toMatchObject({ code: 'NIXL_ERR_MISMATCH' });
    await expect(zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 9 })).rejects.toThrow(
      /no metadata for tp_rank 9/,
    );
  });

  it('answers the 3-tuple and the bare per-rank-port forms', async () => {
    const req = new zmq.Request({ linger: 0, receiveTimeout: 2000 });
    req.connect(`tcp://127.0.0.1:${server.port}`);
    await req.send(encodeMetaRequest(2, 0));
    expect(openHandshakePayload(decodeHandshakePayload((await req.receive())[0]), HASH)).toEqual(meta(2));
    await req.send(GET_META_MSG);
    expect(openHandshakePayload(decodeHandshakePayload((await req.receive())[0]), HASH)).toEqual(meta(0));
    req.close();
  });

  it('garbage frames get an error frame and never kill the listener', async () => {
    const d = new zmq.Dealer({ linger: 0, receiveTimeout: 2000 });
    d.connect(`tcp://127.0.0.1:${server.port}`);
    const before = server.stats.refused;
    for (const junk of [
      Buffer.from([0xc1, 0xff]),
      Buffer.from('hello'),
      packMsgpack([Buffer.from('get_meta_msg'), 'x']),
      packMsgpack(new Map([['a', 1]])),
    ]) {
      await d.send(junk);
      const [reply] = await d.receive();
      expect(() => decodeHandshakePayload(reply)).toThrow(/peer answered with an error/);
    }
    await d.send([Buffer.from('a'), Buffer.from('b'), Buffer.from('c')]); // wrong frame count
    expect(decodeHandshakePayload.bind(null, (await d.receive())[0])).toThrow(/error/);
    d.close();
    // an over-size request: zmq drops that peer; nothing to answer
    const big = new zmq.Dealer({ linger: 0 });
    big.connect(`tcp://127.0.0.1:${server.port}`);
    await big.send(Buffer.alloc(100_000));
    big.close();
    expect(server.stats.refused).toBeGreaterThanOrEqual(before + 5);
    expect(log.lines.length).toBeGreaterThan(0);
    const ok = await zmqHandshake.fetch({ host: '127.0.0.1', port: server.basePort, tpRank: 1 });
    expect(ok.metadata.deviceId).toBe(1);
  });

  it('data-parallel ranks listen on port + dp_rank', async () => {
    const base = await freePort();
    const s = await zmqHandshake.serve({ port: base, dpRank: 1, payloads: payloads(1), logger: log });
    try {
      expect(s.port).toBe(base + 1);
      const got = await zmqHandshake.fetch({ host: '127.0.0.1', port: base, dpRank: 1, tpRank: 0 });
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

  it('serves JSON by dp/tp rank with 404s that say what is missing', async () => {
    const h = new HttpHandshake();
    const s = await h.serve({ port: 0, dpRank: 0, payloads: payloads(2), logger: quietLogger() });
    try {
      expect(s.host).toBe('127.0.0.1');
      const got = await h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 1, expectedHash: HASH });
      expect(got.metadata).toEqual(meta(1)); // 1n << 60n survived JSON as a decimal string
      const all = await (await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata`)).json();
      expect(Object.keys(all['0'])).toEqual(['0', '1']);
      expect(all['0']['1'].agent_metadata.agent_metadata).toBe(Buffer.from('md-1').toString('base64'));
      const r404 = await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata/0/7`);
      expect(r404.status).toBe(404);
      expect((await r404.json()).detail).toMatch(/no metadata for tp_rank 7/);
      await expect(h.fetch({ host: '127.0.0.1', port: s.port, dpRank: 3, tpRank: 0 })).rejects.toThrow(
        /dp_rank 3 is not served/,
      );
      await expect(
        h.fetch({ host: '127.0.0.1', port: s.port, tpRank: 0, expectedHash: 'c'.repeat(64) }),
      ).rejects.toMatchObject({ code: 'NIXL_ERR_MISMATCH' });
      expect((await fetch(`http://127.0.0.1:${s.port}/other`)).status).toBe(404);
      expect(
        (await fetch(`http://127.0.0.1:${s.port}/get_kv_connector_metadata/0`, { method: 'POST', body: 'x' })).status,
      ).toBe(405);
    } finally {
      h.close();
      await s.close();
    }
  });

  it('TLS with a self-signed CA, a client-certificate check and a bearer token', async () => {
    const h = new HttpHandshake();
    const s = await h.serve({
      port: 0,
      payloads: payloads(1),
      logger: quietLogger(),
      bearerToken: 'sekret',
      tls: { cert: certs.serverCert, key: certs.serverKey, clientCa: certs.ca },
    });
    try {
      const base = { host: '127.0.0.1', port: s.port, tpRank: 0, retries: 0, timeoutMs: 2000 };
      const good = { ca: certs.ca, cert: certs.clientCert, key: certs.clientKey };
      const got = await h.fetch({ ...base, tls: good, bearerToken: 'sekret' });
      expect(got.metadata).toEqual(meta(0));
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

  it('garbage on the socket gets a 400, the server lives on; dead and silent peers time out', async () => {
    const h = new HttpHandshake();
    const log = quietLogger();
    const s = await h.serve({ port: 0, payloads: payloads(1), logger: log });
    try {
      for (const junk of ['\x00\x01\x02garbage\r\n\r\n', `GET /${'x'.repeat(20000)} HTTP/1.1\r\n\r\n`]) {
        const answer = await new Promise<string>((resolve) => {
          const c = net.connect(s.port, '127.0.0.1', () => c.write(junk));
          let out = '';
          c.on('data', (d) => (out += d));
          c.on('close', () => resolve(out));
          c.on('error', () => resolve(out));
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
      await s.close();
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
