// startWorker: checks the options, loads the model they name (a GGUF, else
// the synthetic model), then makes and starts the worker; whatever fails on
// the way closes what was made.
import { compileBodySchemas } from '../api/request-checks';
import { LlamaModel } from '../models/llama';
import { SyntheticModel } from '../models/synthetic';
import { DEFAULT_MODEL } from '../models/synthetic-kv';
import type { ServingModel } from '../models/types';
import { type WorkerOptions, checkOptions, kvSecret } from './options';
import { Worker } from './worker';

/** Loads the model the options name, then starts the worker. */
export async function startWorker(o: WorkerOptions = {}): Promise<Worker> {
  checkOptions(o);
  compileBodySchemas(); // at startup, not on the first request
  const model = await loadModel(o);
  let w: Worker;
  try {
    w = new Worker(o, model);
  } catch (e) {
    await model.close();
    throw e;
  }
  try {
    return await w.start();
  } catch (e) {
    await w.close();
    throw e;
  }
}

/** The GGUF the options name, else the synthetic model. */
async function loadModel(o: WorkerOptions): Promise<ServingModel> {
  if (typeof o.model !== 'string') return new SyntheticModel(o.model ?? DEFAULT_MODEL);
  const blockBytes = o.blockBytes ?? 64 << 10;
  return LlamaModel.load({
    modelPath: o.model,
    threads: o.threads,
    contextSize: o.contextSize,
    parallel: o.parallel,
    batchSize: o.batchSize,
    prefixCache: o.prefixCache,
    blockBytes,
    poolBytes: (o.blocks ?? 512) * blockBytes,
    kvSecret: kvSecret(o),
    stateDir: o.stateDir,
  });
}
