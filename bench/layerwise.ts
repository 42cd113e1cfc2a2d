// Layer-wise KV transfer, as vLLM's save_kv_layer, Mooncake and LMCache send
// it: one request per layer, each posted as its layer is marked ready, against
// the same bytes in one request posted once every layer is ready. A KV pull
// (READ) of 32 layers from another process; per layer `blocks` blocks, whose
// remote ids run backwards so that no two descriptors merge (as scattered
// block ids do). Both forms prep their lists once (as a connector does at the
// handshake) and time making, posting and waiting for their requests, from
// the first layer marked ready to the last byte in. ratio = layer-wise time /
// one-request time, per round, median over rounds. A third form is the
// library's layered request (makeLayeredXfer): made once, each layer posted
// with postLayer as it is ready, one wait (layeredRatio).
import { DescList, type DlistHandle, type LayeredXferHandle, type NixlAgent, allocate } from '../lib';
import { benchAgent, type Engine } from './agents';
import { type Peer, startPeer } from './grid';
import { median, nowNs } from './stats';

export const LAYERS = 32;

export interface LayerwiseRow {
  engine: string;
  layers: number;
  blockBytes: number;
  blocksPerLayer: number;
  /** Bytes of the whole pull (every layer). */
  bytes: number;
  /** One request of every layer's blocks: median us, and the range over rounds. */
  oneRequestUs: number;
  oneRequestRange: [number, number];
  /** One request per layer, posted as each layer is marked ready: median us, range. */
  layerwiseUs: number;
  layerwiseRange: [number, number];
  /** Layer-wise / one-request time within a round, median over rounds (goal: <= 1.2). */
  ratio: number;
  ratioRange: [number, number];
  /** One layered request (made once), each layer posted with postLayer as it is ready: median us, range. */
  layeredUs: number;
  layeredRange: [number, number];
  /** Layered / one-request time within a round, median over rounds (goal: <= 1.2). */
  layeredRatio: number;
  layeredRatioRange: [number, number];
}

/** Layer readiness as a sender reports it: a promise per layer, resolved in layer order. */
function layerMarks(layers: number): { ready: Array<Promise<void>>; markAll(): void } {
  const marks: Array<() => void> = [];
  const ready = Array.from({ length: layers }, () => new Promise<void>((r) => marks.push(r)));
  return {
    ready,
    markAll: () => {
      for (const m of marks) m();
    },
  };
}

interface Lists {
  local: DlistHandle;
  remote: DlistHandle;
  /** Per layer: local and remote indices of its blocks. */
  localIdx: Uint32Array[];
  remoteIdx: Uint32Array[];
}

function prepLists(agent: NixlAgent, peer: Peer, base: bigint, blockBytes: number, blocks: number): Lists {
  const n = LAYERS * blocks;
  const triples = (at: bigint) => {
    const t = new BigUint64Array(3 * n);
    for (let i = 0; i < n; i++) {
      t[3 * i] = at + BigInt(i * blockBytes);
      t[3 * i + 1] = BigInt(blockBytes);
    }
    return new DescList(t);
  };
  const local = agent.prepXferDlist('NIXL_INIT_AGENT', triples(base));
  const remote = agent.prepXferDlist(peer.name, triples(peer.addr));
  const localIdx: Uint32Array[] = [];
  const remoteIdx: Uint32Array[] = [];
  for (let l = 0; l < LAYERS; l++) {
    localIdx.push(Uint32Array.from({ length: blocks }, (_, b) => l * blocks + b));
    remoteIdx.push(Uint32Array.from({ length: blocks }, (_, b) => l * blocks + (blocks - 1 - b)));
  }
  return { local, remote, localIdx, remoteIdx };
}

function concat(parts: Uint32Array[]): Uint32Array {
  const out = new Uint32Array(parts.reduce((a, p) => a + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** Every layer's blocks in one request, posted once the last layer is ready. */
async function oneRequest(agent: NixlAgent, lists: Lists, all: { local: Uint32Array; remote: Uint32Array }) {
  const { ready, markAll } = layerMarks(LAYERS);
  const t0 = nowNs();
  markAll();
  await ready[LAYERS - 1];
  const h = agent.makePreppedXfer('READ', lists.local, all.local, lists.remote, all.remote);
  agent.transfer(h);
  await agent.wait(h);
  const us = Number(nowNs() - t0) / 1000;
  agent.releaseXferHandle(h);
  return us;
}

/** One request per layer, each made and posted as its layer is marked ready. */
async function layerwise(agent: NixlAgent, lists: Lists) {
  const { ready, markAll } = layerMarks(LAYERS);
  const t0 = nowNs();
  markAll();
  const handles = [];
  const waits: Array<Promise<void>> = [];
  for (let l = 0; l < LAYERS; l++) {
    await ready[l];
    const h = agent.makePreppedXfer('READ', lists.local, lists.localIdx[l], lists.remote, lists.remoteIdx[l]);
    agent.transfer(h);
    waits.push(agent.wait(h));
    handles.push(h);
  }
  await Promise.all(waits);
  const us = Number(nowNs() - t0) / 1000;
  for (const h of handles) agent.releaseXferHandle(h);
  return us;
}

/** One layered request, made once per block size; each layer posted with postLayer as it is marked ready. */
async function layered(agent: NixlAgent, h: LayeredXferHandle) {
  const { ready, markAll } = layerMarks(LAYERS);
  const t0 = nowNs();
  markAll();
  for (let l = 0; l < LAYERS; l++) {
    await ready[l];
    agent.postLayer(h, l);
  }
  await agent.wait(h);
  return Number(nowNs() - t0) / 1000;
}

/**
 * The layer-wise pull against the one-request pull on one engine, per block
 * size, the two alternating round by round (warm-up round first).
 */
export async function benchLayerwise(
  engine: Engine,
  rounds: number,
  sizes: ReadonlyArray<{ blockBytes: number; blocksPerLayer: number }>,
): Promise<LayerwiseRow[]> {
  const poolBytes = Math.max(...sizes.map((s) => LAYERS * s.blockBytes * s.blocksPerLayer));
  const agent = benchAgent('bench-layerwise', engine);
  const mem = allocate(poolBytes);
  mem.fill(1);
  agent.registerMemory(mem);
  const base = DescList.from(mem).addr(0);
  const peer = await startPeer(agent, poolBytes);
  const rows: LayerwiseRow[] = [];
  try {
    for (const { blockBytes, blocksPerLayer } of sizes) {
      const lists = prepLists(agent, peer, base, blockBytes, blocksPerLayer);
      const all = { local: concat(lists.localIdx), remote: concat(lists.remoteIdx) };
      const h = agent.makeLayeredXfer('READ', lists.local, lists.localIdx, lists.remote, lists.remoteIdx);
      const one: number[] = [];
      const lw: number[] = [];
      const ly: number[] = [];
      const ratios: number[] = [];
      const lyRatios: number[] = [];
      for (let r = -1; r < rounds; r++) {
        // The three forms rotate within a round, so none always follows the same one.
        const order = [0, 1, 2].map((k) => (k + r + 1) % 3);
        const t = [0, 0, 0];
        for (const k of order)
          t[k] = await (k === 0
            ? oneRequest(agent, lists, all)
            : k === 1
              ? layerwise(agent, lists)
              : layered(agent, h));
        if (r < 0) continue;
        one.push(t[0]);
        lw.push(t[1]);
        ly.push(t[2]);
        ratios.push(t[1] / t[0]);
        lyRatios.push(t[2] / t[0]);
      }
      agent.releaseXferHandle(h);
      agent.releaseDlistHandle(lists.local);
      agent.releaseDlistHandle(lists.remote);
      rows.push({
        engine: agent.engine,
        layers: LAYERS,
        blockBytes,
        blocksPerLayer,
        bytes: LAYERS * blocksPerLayer * blockBytes,
        oneRequestUs: median(one),
        oneRequestRange: [Math.min(...one), Math.max(...one)],
        layerwiseUs: median(lw),
        layerwiseRange: [Math.min(...lw), Math.max(...lw)],
        ratio: median(ratios),
        ratioRange: [Math.min(...ratios), Math.max(...ratios)],
        layeredUs: median(ly),
        layeredRange: [Math.min(...ly), Math.max(...ly)],
        layeredRatio: median(lyRatios),
        layeredRatioRange: [Math.min(...lyRatios), Math.max(...lyRatios)],
      });
    }
  } finally {
    await peer.close();
    agent.close();
  }
  return rows;
}
