// node-llama-cpp saves and loads a sequence's state only through a file:
// each state on its way out of llama.cpp or into it goes through a file of
// its own in the model's state directory (state-dir.ts: a memory file system
// where there is one), removed once read or loaded.
import { randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { KvRejected } from '../types';

function tempFile(dir: string): string {
  return path.join(dir, `${randomUUID()}.state`);
}

function remove(file: string): void {
  fs.rm(file, { force: true }, () => {});
}

/** The sequence's state as llama.cpp saves it. */
export async function saveState(dir: string, seq: Nlc.LlamaContextSequence): Promise<Buffer> {
  const file = tempFile(dir);
  try {
    await seq.saveStateToFile(file);
    return await fs.promises.readFile(file);
  } finally {
    remove(file);
  }
}

/**
 * Loads `state` into the (cleared) sequence. Throws KvRejected 'refused'
 * when llama.cpp refuses it: the caller throws that context away.
 */
export async function loadState(dir: string, seq: Nlc.LlamaContextSequence, state: Buffer): Promise<void> {
  const file = tempFile(dir);
  try {
    await fs.promises.writeFile(file, state);
    try {
      await seq.loadStateFromFile(file, { acceptRisk: true });
    } catch (e) {
      throw new KvRejected(`llama.cpp refused the KV state: ${(e as Error).message}`, 'refused');
    }
  } finally {
    remove(file);
  }
}
