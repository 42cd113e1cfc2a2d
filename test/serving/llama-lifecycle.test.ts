// GGUF models opened and closed over and over in one process (tests, the
// bench, an app that restarts its workers) leave nothing behind that grows:
// no process listeners, no warning.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { LlamaModel } from '../../lib/serving/models/llama';
import { modelPath } from '../../lib/serving/models/test-models';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-llama-life-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

it('twelve models loaded and closed one after another, and four at once: no beforeExit listener piles up', async () => {
  const open = () =>
    LlamaModel.load({
      modelPath: modelPath('tiny', dir),
      contextSize: 256,
      threads: 1,
      parallel: 1,
      blockBytes: 1 << 16,
      poolBytes: 16 << 20,
    });
  const warnings: string[] = [];
  const onWarning = (w: Error) => warnings.push(w.name);
  process.on('warning', onWarning);
  try {
    await (await open()).close(); // the first may set up what a process keeps (one binding)
    const base = process.listenerCount('beforeExit');
    for (let i = 0; i < 12; i++) await (await open()).close();
    const four = await Promise.all([open(), open(), open(), open()]);
    for (const m of four) await m.close();
    expect(process.listenerCount('beforeExit')).toBe(base);
    await new Promise((r) => setImmediate(r));
    expect(warnings).not.toContain('MaxListenersExceededWarning');
  } finally {
    process.off('warning', onWarning);
  }
}, 180_000);
