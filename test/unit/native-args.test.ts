// Every native method, handed each wrong argument type, answers
// NIXL_ERR_INVALID_PARAM naming the argument: nothing is coerced (issue 14).
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { afterAll, describe, expect, it } from 'vitest';
import { NixlError } from '../../lib';
import { binding, type NativeAgent } from '../../lib/native';

type Kind =
  | 'string'
  | 'handle'
  | 'descs'
  | 'memType'
  | 'bool'
  | 'strings?'
  | 'blob?'
  | 'blob'
  | 'port?'
  | 'ip?'
  | 'params?'
  | 'indices'
  | 'op'
  | 'array'
  | 'buffer';

// Values of the wrong type for each kind of argument.
const wrong: Record<Kind, unknown[]> = {
  string: [42, null, undefined, {}, Buffer.from('x'), true],
  handle: ['1', null, undefined, {}, 1n, true],
  descs: [[1, 2, 3], new Uint32Array(3), new BigInt64Array(3), null, 'x'],
  memType: ['DRAM', null, undefined, 7, -1, 1.5, {}],
  bool: [1, 0, 'true', null, undefined, {}],
  'strings?': ['UCX', [1], {}, 42],
  'blob?': [42, {}, true, [1]],
  blob: [42, {}, true, undefined, null],
  'port?': ['80', -1, 70000, 1.5, {}, true],
  'ip?': [42, {}, true],
  'params?': ['x', ['a'], { a: 1 }, { a: null }, 42],
  indices: [[0], new Int32Array(1), null, 'x'],
  op: ['read', 1, null, {}],
  array: ['x', 42, null, {}],
  buffer: ['metadata', 42, null, {}],
};

const mem = binding.allocate(8192);
const addr = binding.addressOf(mem);
const triple = new BigUint64Array([addr, 4096n, 0n]);
const agent = new binding.NativeAgent('args-a', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
const peer = new binding.NativeAgent('args-b', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
const reg = agent.registerMem(triple, 0, undefined, [mem]);
const peerMem = binding.allocate(4096);
const peerTriple = new BigUint64Array([binding.addressOf(peerMem), 4096n, 0n]);
peer.registerMem(peerTriple, 0, undefined, [peerMem]);
agent.loadRemoteMD(peer.getLocalMD());
const dl = agent.prepXferDlist('', triple, 0, undefined);
const xfer = agent.createXferReq('READ', triple, 0, peerTriple, 0, 'args-b', undefined);
afterAll(() => {
  agent.close();
  peer.close();
});

// method, then each argument as [kind, a valid value].
const methods: Array<[keyof NativeAgent, Array<[Kind, unknown]>]> = [
  ['getPluginParams', [['string', 'LOOPBACK']]],
  [
    'createBackend',
    [
      ['string', 'LOOPBACK'],
      ['params?', {}],
    ],
  ],
  [
    'registerMem',
    [
      ['descs', triple],
      ['memType', 0],
      ['strings?', undefined],
      ['array', []],
    ],
  ],
  ['deregisterMem', [['handle', reg]]],
  ['loadRemoteMD', [['buffer', Buffer.alloc(4)]]],
  ['invalidateRemoteMD', [['string', 'nobody']]],
  [
    'getLocalPartialMD',
    [
      ['descs', triple],
      ['memType', 0],
      ['bool', false],
      ['strings?', undefined],
    ],
  ],
  [
    'sendLocalMD',
    [
      ['ip?', undefined],
      ['port?', undefined],
    ],
  ],
  [
    'sendLocalPartialMD',
    [
      ['descs', triple],
      ['memType', 0],
      ['bool', false],
      ['strings?', undefined],
      ['ip?', undefined],
      ['port?', undefined],
      ['ip?', 'kv'], // the label: an optional string
    ],
  ],
  [
    'fetchRemoteMD',
    [
      ['string', 'x'],
      ['ip?', undefined],
      ['port?', undefined],
      ['ip?', undefined], // the label
    ],
  ],
  [
    'invalidateLocalMD',
    [
      ['ip?', undefined],
      ['port?', undefined],
    ],
  ],
  [
    'checkRemoteMD',
    [
      ['string', 'args-b'],
      ['descs', triple],
      ['memType', 0],
    ],
  ],
  ['makeConnection', [['string', 'args-b']]],
  [
    'queryMem',
    [
      ['descs', triple],
      ['memType', 0],
      ['strings?', undefined],
    ],
  ],
  ['estimateXferCost', [['handle', xfer]]],
  [
    'prepXferDlist',
    [
      ['string', ''],
      ['descs', triple],
      ['memType', 0],
      ['strings?', undefined],
    ],
  ],
  ['releaseDlist', [['handle', dl]]],
  [
    'makeXferReq',
    [
      ['op', 'READ'],
      ['handle', dl],
      ['indices', new Uint32Array([0])],
      ['handle', dl],
      ['indices', new Uint32Array([0])],
      ['blob?', undefined],
    ],
  ],
  [
    'createXferReq',
    [
      ['op', 'READ'],
      ['descs', triple],
      ['memType', 0],
      ['descs', peerTriple],
      ['memType', 0],
      ['string', 'args-b'],
      ['blob?', undefined],
    ],
  ],
  [
    'postXferReq',
    [
      ['handle', xfer],
      ['blob?', undefined],
    ],
  ],
  ['getXferStatus', [['handle', xfer]]],
  ['releaseXferReq', [['handle', xfer]]],
  ['getXferTelemetry', [['handle', xfer]]],
  [
    'genNotif',
    [
      ['string', 'args-b'],
      ['blob', 'hi'],
    ],
  ],
  ['watchNotifs', [['bool', false]]],
];

function errorOf(f: () => unknown): NixlError | undefined {
  try {
    f();
  } catch (e) {
    return e as NixlError;
  }
  return undefined;
}

describe('native methods refuse arguments of the wrong type', () => {
  const cases = methods.flatMap(([name, args]) =>
    args.flatMap(([kind], pos) => wrong[kind].map((bad) => [name, pos, kind, bad] as const)),
  );

  it.each(cases)('%s argument %i (%s) = %o', (name, pos, _kind, bad) => {
    const args = methods.find(([n]) => n === name)![1].map(([, v]) => v);
    args[pos] = bad;
    const e = errorOf(() => (agent[name] as (...a: unknown[]) => unknown).apply(agent, args));
    expect(e, `${String(name)} accepted ${String(bad)}`).toBeInstanceOf(NixlError);
    expect(e!.code, e!.message).toBe('NIXL_ERR_INVALID_PARAM');
  });

  it('the constructor checks each option once, by type', () => {
    const opts: Array<[string, unknown]> = [
      ['engine', 42],
      ['backends', 'LOOPBACK'],
      ['progressThread', 'yes'],
      ['progressDelayUs', -1],
      ['captureTelemetry', 1],
      ['listenPort', 'x'],
      ['testDelayUs', 1.5],
      ['testFirstHandle', 0],
      ['testFirstHandle', 2 ** 53],
    ];
    for (const [k, v] of opts) {
      const e = errorOf(
        () => new binding.NativeAgent('args-c', { engine: 'loopback', backends: [], [k]: v } as never, () => {}),
      );
      expect(e, k).toBeInstanceOf(NixlError);
      expect(e!.code).toBe('NIXL_ERR_INVALID_PARAM');
      expect(e!.message).toContain(`options.${k}`);
    }
    expect(
      errorOf(() => new binding.NativeAgent(42 as never, { engine: 'loopback', backends: [] }, () => {}))?.code,
    ).toBe('NIXL_ERR_INVALID_PARAM');
    expect(errorOf(() => new binding.NativeAgent('x', null as never, () => {}))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });

  it('a handle is an integer 1..2^53-1: past that "no such handle", inside it looked up (NIXL_ERR_NOT_FOUND both)', () => {
    for (const h of [0, -1, 1.5, 2 ** 53, 2 ** 64, Number.POSITIVE_INFINITY, Number.NaN]) {
      const e = errorOf(() => agent.getXferStatus(h));
      expect(e?.code, String(h)).toBe('NIXL_ERR_NOT_FOUND');
      expect(e?.message, String(h)).toContain('no such handle');
    }
    for (const h of [2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, 2 ** 52 - 1, 2 ** 53 - 1]) {
      const e = errorOf(() => agent.getXferStatus(h));
      expect(e?.code, String(h)).toBe('NIXL_ERR_NOT_FOUND');
      expect(e?.message, String(h)).not.toContain('no such handle');
    }
  });

  it('module functions too', () => {
    for (const bad of ['1', null, {}, 0, -5, 1.5])
      expect(errorOf(() => binding.allocate(bad as never))?.code).toBe('NIXL_ERR_INVALID_PARAM');
    for (const bad of ['x', 42, null, {}])
      expect(errorOf(() => binding.addressOf(bad as never))?.code).toBe('NIXL_ERR_INVALID_PARAM');
    expect(errorOf(() => binding.setErrorFactory('x' as never))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
});

it('the codec, the TP mapping and the errors load without the addon', async () => {
  const { execFileSync } = await import('node:child_process');
  const path = await import('node:path');
  const root = path.join(__dirname, '..', '..');
  // A broken addon path: anything that loads the addon throws.
  const out = execFileSync(
    process.execPath,
    [
      '-e',
      `
    const c = require('./dist/lib/handshake');
    const tp = require('./dist/lib/kv/tp');
    const e = require('./dist/lib/errors');
    console.log(typeof c.encodeAgentMetadata, typeof tp.planReads, new e.NixlError('x', 'NIXL_ERR_NOT_FOUND').status);
  `,
    ],
    { cwd: root, env: { ...process.env, NIXL_NODE_ADDON: '/nonexistent/addon.node' } },
  ).toString();
  expect(out.trim()).toBe('function function -4');
});

// postLayer is a function of its own (layerPoster), not a method: the same
// refusals, and a poster kept past its agent's close refuses too.
describe('the layer poster refuses bad arguments and a closed agent', () => {
  const post = agent.layerPoster();
  const layered = agent.makeLayeredXferReq(
    'READ',
    dl,
    new Uint32Array([0]),
    agent.prepXferDlist('args-b', peerTriple, 0, undefined),
    new Uint32Array([0]),
    new Uint32Array([0, 1]),
    undefined,
    'args-b',
  )[0];

  it.each(wrong.handle)('handle %o', (bad) => {
    expect(errorOf(() => post(bad as number, 0, true))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
  it.each(['0', null, undefined, {}, -1, 1.5, 2 ** 32, Number.NaN])('layer %o', (bad) => {
    expect(errorOf(() => post(layered, bad as number, true))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
  it('an engine handle, an unknown layered handle', () => {
    expect(errorOf(() => post(xfer, 0, true))?.code).toBe('NIXL_ERR_NOT_FOUND');
    expect(errorOf(() => post(layered + 1, 0, true))?.code).toBe('NIXL_ERR_NOT_FOUND');
  });
  it('a closed agent', () => {
    const c = new binding.NativeAgent('args-closed', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
    const cpost = c.layerPoster();
    c.close();
    expect(errorOf(() => cpost(0x80000000, 0, true))?.code).toBe('NIXL_ERR_NOT_ALLOWED');
  });
  it('a poster kept after its agent was collected refuses, touching nothing of it', async () => {
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    const kept = (() => {
      const c = new binding.NativeAgent('args-gone', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
      return c.layerPoster();
    })();
    // The agent's destructor runs when the collector finalizes it: a few rounds, each with a turn of the loop.
    let e: NixlError | undefined;
    for (let i = 0; i < 20 && e?.message !== 'postLayer: the agent is gone'; i++) {
      gc();
      await new Promise((r) => setImmediate(r));
      e = errorOf(() => kept(0x80000000, 0, true));
    }
    expect(e?.message).toBe('postLayer: the agent is gone');
    expect(e?.code).toBe('NIXL_ERR_NOT_ALLOWED');
  });
});

// postXfer (xferPoster) is postXferReq as a function of its own, its message
// last and read only when given: the same refusals, a closed agent refused.
describe('the transfer poster refuses bad arguments and a closed agent', () => {
  const post = agent.xferPoster();

  it.each(wrong.handle)('handle %o', (bad) => {
    expect(errorOf(() => post(bad as number, true))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
  it.each(['true', 1, {}])('mayInline %o', (bad) => {
    expect(errorOf(() => post(xfer, bad as boolean))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
  it.each(wrong['blob?'])('message %o', (bad) => {
    expect(errorOf(() => post(xfer, true, bad as string))?.code).toBe('NIXL_ERR_INVALID_PARAM');
  });
  it('an unknown handle', () => {
    expect(errorOf(() => post(xfer + 1000, true))?.code).toBe('NIXL_ERR_NOT_FOUND');
  });
  it('a closed agent', () => {
    const c = new binding.NativeAgent('args-closed-x', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
    const cpost = c.xferPoster();
    c.close();
    expect(errorOf(() => cpost(1, true))?.code).toBe('NIXL_ERR_NOT_ALLOWED');
  });
  it('a poster kept after its agent was collected refuses, touching nothing of it', async () => {
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    const kept = (() => {
      const c = new binding.NativeAgent('args-gone-x', { engine: 'loopback', backends: ['LOOPBACK'] }, () => {});
      return c.xferPoster();
    })();
    let e: NixlError | undefined;
    for (let i = 0; i < 20 && e?.message !== 'postXfer: the agent is gone'; i++) {
      gc();
      await new Promise((r) => setImmediate(r));
      e = errorOf(() => kept(1, true));
    }
    expect(e?.message).toBe('postXfer: the agent is gone');
    expect(e?.code).toBe('NIXL_ERR_NOT_ALLOWED');
  });
});
