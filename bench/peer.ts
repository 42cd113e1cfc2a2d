// A process that owns the remote memory for cross-process benchmarks.
import { type NixlAgent, allocate, DescList } from '../lib';
import { benchAgent, type Engine } from './agents';

let agent: NixlAgent | undefined;
process.on('message', (m: { cmd: string; bytes?: number; shared?: boolean; md?: Uint8Array }) => {
  if (m.cmd === 'init') {
    agent = benchAgent('bench-remote', (process.env.NIXL_NODE_ENGINE as Engine) ?? 'loopback');
    const mem = m.shared ? allocate(m.bytes!) : Buffer.alloc(m.bytes!);
    mem.fill(0x5a);
    agent.registerMemory(mem);
    process.send!({ md: agent.getAgentMetadata(), addr: DescList.from(mem).addr(0) });
  } else if (m.cmd === 'load') {
    agent!.addRemoteAgent(Buffer.from(m.md!));
    process.send!({ ok: true });
  } else if (m.cmd === 'exit') {
    agent?.close();
    process.exit(0);
  }
});
