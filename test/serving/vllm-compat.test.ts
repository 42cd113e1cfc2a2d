// Coming from vLLM (issue 48.1-3), as a user would: workers started through
// the CLI with vLLM's flags serve under --served-model-name, and after a
// prefill / decode request through the proxy their /metrics carry vLLM's
// series with vLLM's types, buckets and labels (the values below are read
// from vLLM's source: vllm/v1/metrics/loggers.py PrometheusStatLogger and the
// NIXL connector's NixlPromMetrics); answer ids carry OpenAI's prefixes, and
// the client's X-Request-Id is kept through the proxy.
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ROOT } from '../helpers';

const BIN = path.join(ROOT, 'bin', 'nixl-node.js');
const procs: ChildProcess[] = [];

/** Starts a nixl-node command; resolves with its ready line. */
function start(args: string[], env: Record<string, string> = {}): Promise<Record<string, unknown>> {
  const p = spawn(process.execPath, [BIN, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  procs.push(p);
  let err = '';
  p.stderr!.on('data', (d) => {
    err += d;
  });
  return new Promise((resolve, reject) => {
    readline.createInterface({ input: p.stdout! }).once('line', (l) => resolve(JSON.parse(l)));
    p.once('exit', (c) => reject(new Error(`${args[0]} exited ${c}: ${err}`)));
  });
}

/** Each metric family of a Prometheus text: its type, bucket bounds, label names and samples. */
function families(text: string) {
  const out = new Map<string, { type: string; le: number[]; labels: Set<string>; samples: Map<string, number> }>();
  for (const line of text.split('\n')) {
    const t = /^# TYPE (\S+) (\S+)$/.exec(line);
    if (t) out.set(t[1], { type: t[2], le: [], labels: new Set(), samples: new Map() });
    const s = /^([^\s{]+)(?:\{([^}]*)\})? (\S+)$/.exec(line);
    if (!s) continue;
    const fam = [...out.keys()].reverse().find((n) => s[1] === n || s[1].startsWith(`${n}_`));
    if (!fam) continue;
    const f = out.get(fam)!;
    const labels = Object.fromEntries([...(s[2] ?? '').matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
    for (const k of Object.keys(labels)) if (k !== 'le') f.labels.add(k);
    if (s[1] === `${fam}_bucket` && labels.le !== '+Inf') f.le.push(Number(labels.le));
    f.samples.set(s[1], (f.samples.get(s[1]) ?? 0) + Number(s[3]));
  }
  return out;
}

// vLLM's: name -> [type, buckets]. Counters as its Python client writes them (with _total).
const TTFT = [
  0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
  640.0, 2560.0,
];
const ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E = [
  0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
  7680.0,
];
const NIXL_TIME = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];
const VLLM: Record<string, [string, number[]]> = {
  'vllm:nixl_xfer_time_seconds': ['histogram', NIXL_TIME.slice(1)],
  'vllm:nixl_post_time_seconds': ['histogram', NIXL_TIME],
  'vllm:nixl_bytes_transferred': ['histogram', [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23].map((i) => 2 ** (10 + i))],
  'vllm:nixl_num_descriptors': [
    'histogram',
    [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
  ],
  'vllm:nixl_num_failed_transfers_total': ['counter', []],
  'vllm:nixl_num_failed_notifications_total': ['counter', []],
  'vllm:nixl_num_kv_expired_reqs_total': ['counter', []],
  'vllm:time_to_first_token_seconds': ['histogram', TTFT],
  'vllm:inter_token_latency_seconds': ['histogram', ITL],
  'vllm:e2e_request_latency_seconds': ['histogram', E2E],
  'vllm:num_requests_running': ['gauge', []],
  'vllm:num_requests_waiting': ['gauge', []],
  'vllm:kv_cache_usage_perc': ['gauge', []],
  'vllm:prefix_cache_queries_total': ['counter', []],
  'vllm:prefix_cache_hits_total': ['counter', []],
};

let prefill: string;
let decode: string;
let proxy: string;
beforeAll(async () => {
  const flags = (role: string) => [
    'worker',
    '--port',
    '0',
    '--served-model-name',
    'acme/llm-7b',
    'acme-llm',
    '--max-model-len',
    '4k',
    '--block-size',
    '16',
    '--kv-transfer-config',
    JSON.stringify({
      kv_connector: 'NixlConnector',
      kv_role: role,
      kv_connector_extra_config: { backends: ['UCX'], kv_lease_duration: 2 },
    }),
  ];
  const [p, d] = await Promise.all([
    start(flags('kv_producer'), { VLLM_NIXL_SIDE_CHANNEL_HOST: '127.0.0.1' }),
    start(flags('kv_consumer')),
  ]);
  expect(p.served_model_names).toEqual(['acme/llm-7b', 'acme-llm']);
  prefill = p.address as string;
  decode = d.address as string;
  proxy = (await start(['proxy', '--port', '0', '--prefill', prefill, '--decode', decode])).url as string;
}, 60_000);
afterAll(() => {
  for (const p of procs) if (p.exitCode === null) p.kill('SIGKILL');
});

const post = (url: string, body: unknown, headers: Record<string, string> = {}) =>
  fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
  });

describe('a worker started with vLLM flags', () => {
  it('serves under --served-model-name: every name answers, the first is the one reported', async () => {
    const models = (await (await fetch(`${decode}/v1/models`)).json()) as { data: Array<{ id: string }> };
    expect(models.data.map((m) => m.id)).toEqual(['acme/llm-7b', 'acme-llm']);
    const r = await post(`${decode}/v1/completions`, { model: 'acme-llm', prompt: 'hi', max_tokens: 2 });
    expect(r.status).toBe(200);
    expect(((await r.json()) as { model: string }).model).toBe('acme-llm');
    const other = await post(`${decode}/v1/completions`, { model: 'nixl-node/synthetic', prompt: 'hi' });
    expect(other.status).toBe(404);
  });

  it("after a P/D request through the proxy, /metrics has each of vLLM's series with its type, buckets and labels", async () => {
    const count = (f: ReturnType<typeof families>, name: string) => f.get(name)?.samples.get(`${name}_count`) ?? 0;
    const before = families(await (await fetch(`${decode}/metrics`)).text());
    const r = await post(`${proxy}/v1/completions`, {
      model: 'acme/llm-7b',
      prompt: 'a prompt long enough to fill more than one block of sixteen tokens',
      max_tokens: 4,
      stream: true,
    });
    expect(r.status).toBe(200);
    await r.text();
    const res = await fetch(`${decode}/metrics`);
    expect(res.headers.get('content-type')).toMatch(/^text\/plain/);
    const f = families(await res.text());
    for (const [name, [type, le]] of Object.entries(VLLM)) {
      const got = f.get(name);
      expect(got, name).toBeDefined();
      expect({ name, type: got!.type, le: got!.le }).toEqual({ name, type, le });
      expect([...got!.labels].sort(), name).toEqual(['engine', 'model_name']);
      expect(got!.samples.size, `${name} has a sample`).toBeGreaterThan(0);
    }
    // The decode pulled the KV: one transfer at least, its bytes and descriptors counted.
    expect(f.get('vllm:nixl_xfer_time_seconds')!.samples.get('vllm:nixl_xfer_time_seconds_count')).toBeGreaterThan(0);
    expect(f.get('vllm:nixl_bytes_transferred')!.samples.get('vllm:nixl_bytes_transferred_sum')).toBeGreaterThan(0);
    expect(f.get('vllm:nixl_num_descriptors')!.samples.get('vllm:nixl_num_descriptors_count')).toBeGreaterThan(0);
    // Four tokens: one time to the first, three between tokens, one end to end.
    const more = (name: string) => count(f, name) - count(before, name);
    expect(more('vllm:time_to_first_token_seconds')).toBe(1);
    expect(more('vllm:inter_token_latency_seconds')).toBe(3);
    expect(more('vllm:e2e_request_latency_seconds')).toBe(1);
    // nixl-node's own series are on the same page.
    expect(f.get('nixl_node_transfers_total')?.type).toBe('counter');
  });

  it('a prefill counts the requests whose KV expired unread (vllm:nixl_num_kv_expired_reqs, on the P instance)', async () => {
    const r = await post(`${prefill}/v1/completions`, {
      model: 'acme/llm-7b',
      prompt: 'nobody will read this',
      max_tokens: 1,
      kv_transfer_params: { do_remote_decode: true },
    });
    expect(r.status).toBe(200);
    await r.json();
    const expired = async () =>
      families(await (await fetch(`${prefill}/metrics`)).text())
        .get('vllm:nixl_num_kv_expired_reqs_total')!
        .samples.get('vllm:nixl_num_kv_expired_reqs_total');
    // The lease (kv_lease_duration 2 s) runs out with nobody reading.
    for (let i = 0; i < 100 && (await expired()) === 0; i++) await new Promise((res) => setTimeout(res, 100));
    expect(await expired()).toBe(1);
  });

  it('the proxy times the answers it gives per route: TTFT, inter-token latency, end to end', async () => {
    const f = families(await (await fetch(`${proxy}/metrics`)).text());
    for (const [name, le] of [
      ['nixl_node_proxy_time_to_first_token_seconds', TTFT],
      ['nixl_node_proxy_inter_token_latency_seconds', ITL],
      ['nixl_node_proxy_e2e_request_latency_seconds', E2E],
    ] as const) {
      expect(f.get(name)?.type, name).toBe('histogram');
      expect(f.get(name)!.le).toEqual(le);
      expect(f.get(name)!.labels).toEqual(new Set(['route']));
    }
    expect(
      f
        .get('nixl_node_proxy_e2e_request_latency_seconds')!
        .samples.get('nixl_node_proxy_e2e_request_latency_seconds_count'),
    ).toBeGreaterThan(0);
  });
});

describe("OpenAI's conventions through the proxy", () => {
  it('ids are cmpl-... and chatcmpl-...; the client X-Request-Id is kept in the header and the id', async () => {
    const r = await post(
      `${proxy}/v1/completions`,
      { model: 'acme/llm-7b', prompt: 'hello', max_tokens: 3, stream: true },
      { 'x-request-id': 'client-req-7' },
    );
    expect(r.headers.get('x-request-id')).toBe('client-req-7');
    const ids = new Set(
      (await r.text())
        .split('\n')
        .filter((l) => l.startsWith('data: {'))
        .map((l) => JSON.parse(l.slice(6)).id),
    );
    expect([...ids]).toEqual(['cmpl-client-req-7']);
    const chat = await post(
      `${proxy}/v1/chat/completions`,
      { model: 'acme/llm-7b', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 },
      { 'x-request-id': 'client-req-8' },
    );
    expect(((await chat.json()) as { id: string }).id).toBe('chatcmpl-client-req-8');
    // Without one: the proxy's own id, still with the prefix.
    const plain = await post(`${proxy}/v1/chat/completions`, {
      model: 'acme/llm-7b',
      messages: [{ role: 'user', content: 'hi' }],
      max_tokens: 2,
    });
    const id = ((await plain.json()) as { id: string }).id;
    expect(id).toMatch(/^chatcmpl-[0-9a-f-]{36}$/);
    expect(plain.headers.get('x-request-id')).toBe(id.slice('chatcmpl-'.length));
  });
});

describe('without prom-client', () => {
  it('a worker still serves; its /metrics is a 501 naming the package', () => {
    // In a process of its own, where requiring prom-client fails as it does when it is not installed.
    const script = `
      const Module = require('node:module');
      const resolve = Module._resolveFilename;
      Module._resolveFilename = function (name, ...rest) {
        if (name === 'prom-client') throw Object.assign(new Error('Cannot find module'), { code: 'MODULE_NOT_FOUND' });
        return resolve.call(this, name, ...rest);
      };
      const { startWorker } = require(${JSON.stringify(path.join(ROOT, 'dist/lib/serving'))});
      (async () => {
        const w = await startWorker();
        const m = await fetch(w.address + '/metrics');
        const c = await fetch(w.address + '/v1/completions', { method: 'POST', body: JSON.stringify({ prompt: 'x', max_tokens: 1 }) });
        console.log(JSON.stringify({ metrics: m.status, body: await m.json(), completion: c.status }));
        await w.close();
      })();`;
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', timeout: 20_000 });
    expect(JSON.parse(r.stdout), r.stderr).toEqual({
      metrics: 501,
      body: { error: { message: expect.stringMatching(/npm install prom-client/), type: 'not_implemented' } },
      completion: 200,
    });
  });
});
