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

// A state is megabytes (8 KiB a token for the bench's model) and every
// prefill and decode moves one: fs.promises.readFile / writeFile go in
// 512 KiB pieces, one thread-pool round trip and event-loop turn each (about
// 20 for a 1266-token prompt, ~11 ms of a 66 ms prefix hit measured in a
// worker), where one read or write of the whole buffer takes 2-4 ms.

/** The whole file, read in as few calls as the kernel allows. */
export async function readWhole(file: string): Promise<Buffer> {
  const fh = await fs.promises.open(file, 'r');
  try {
    const size = (await fh.stat()).size;
    const out = Buffer.allocUnsafe(size);
    let done = 0;
    while (done < size) {
      const { bytesRead } = await fh.read(out, done, size - done, done);
      if (bytesRead === 0) return out.subarray(0, done); // shorter than it said: what is there
      done += bytesRead;
    }
    return out;
  } finally {
    await fh.close();
  }
}

/** Writes `data` to a new file, in as few calls as the kernel allows. */
export async function writeWhole(file: string, data: Buffer): Promise<void> {
  const fh = await fs.promises.open(file, 'w');
  try {
    let done = 0;
    while (done < data.length) done += (await fh.write(data, done, data.length - done, done)).bytesWritten;
  } finally {
    await fh.close();
  }
}

/** The sequence's state as llama.cpp saves it. */
export async function saveState(dir: string, seq: Nlc.LlamaContextSequence): Promise<Buffer> {
  const file = tempFile(dir);
  try {
    await seq.saveStateToFile(file);
    return await readWhole(file);
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
    await writeWhole(file, state);
    try {
      await seq.loadStateFromFile(file, { acceptRisk: true });
    } catch (e) {
      throw new KvRejected(`llama.cpp refused the KV state: ${(e as Error).message}`, 'refused');
    }
  } finally {
    remove(file);
  }
}
