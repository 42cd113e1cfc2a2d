// node-llama-cpp alone on the tiny GGUF (what every answer is checked
// against) and a prefill and a decode worker on it, started before a
// describe's tests and closed after them: the set-up of the GGUF hostile-input
// tests. Its fields are set once beforeAll has run.
import { afterAll, beforeAll } from 'vitest';
import { OneProcess } from '../../demo/llama-reference';
import { type Worker, type WorkerOptions, startWorker } from '../../lib/serving';
import { modelPath } from '../../lib/serving/models/test-models';

export function ggufTrio(
  dir: string,
  ctx: { contextSize: number; threads: number; batchSize?: number },
  workers: (gguf: string) => { prefill: WorkerOptions; decode: WorkerOptions },
): { ref: OneProcess; prefill: Worker; decode: Worker } {
  const t = {} as { ref: OneProcess; prefill: Worker; decode: Worker };
  beforeAll(async () => {
    const gguf = modelPath('tiny', dir);
    t.ref = await OneProcess.load(gguf, ctx);
    const o = workers(gguf);
    t.prefill = await startWorker(o.prefill);
    t.decode = await startWorker(o.decode);
  }, 120_000);
  afterAll(async () => {
    await t.prefill?.close();
    await t.decode?.close();
    await t.ref?.close();
  });
  return t;
}
