// node-llama-cpp saves and loads a sequence's state only through a file:
// each state on its way out of llama.cpp or into it goes through a file in
// the model's state directory (state-dir.ts: a memory file system where
// there is one), all removed with the directory when the model closes.
//
// Loads go through a few slots used again and again, one per load in flight
// (at most a worker's contexts): on a memory file system a new file's pages
// are allocated and zeroed as it is written, 6-17 ms for a 10 MiB state on
// the bench machine, where writing over the pages of a file of about that
// size takes 1.5 ms. Saves go to a new file each, removed after it is read,
// off the request's path: llama.cpp opens the file it saves to truncated, and
// truncating a slot's 10 MiB there costs the request about 1.4 ms more than
// a new file (measured alike).
//
// Reads and writes are synchronous: each is one copy of a few megabytes in
// memory (1-2 ms), which the thread pool would only wrap in a hand-off each
// way and an event-loop turn behind whatever else is queued.
import { randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type * as Nlc from 'node-llama-cpp';
import { KvRejected } from '../types';
import type { StateBuffers } from './state-buffers';

/** The whole file, read into a buffer of `buffers` (the caller gives it back). */
export function readInto(file: string, buffers: StateBuffers): Buffer {
  const fd = fs.openSync(file, 'r');
  let out: Buffer | undefined;
  try {
    const size = fs.fstatSync(fd).size;
    out = buffers.take(size);
    let done = 0;
    while (done < size) {
      const n = fs.readSync(fd, out, done, size - done, done);
      if (n === 0) return out.subarray(0, done); // shorter than it said: what is there
      done += n;
    }
    return out;
  } catch (e) {
    if (out) buffers.give(out);
    throw e;
  } finally {
    fs.closeSync(fd);
  }
}

/** Makes `file` hold exactly `data`, writing over the pages it has (never truncated to 0 first). */
export function writeOver(file: string, data: Buffer): void {
  const fd = fs.openSync(file, fs.constants.O_WRONLY | fs.constants.O_CREAT, 0o600);
  try {
    let done = 0;
    while (done < data.length) done += fs.writeSync(fd, data, done, data.length - done, done);
    fs.ftruncateSync(fd, data.length);
  } finally {
    fs.closeSync(fd);
  }
}

/** The state files of one model, in its state directory: a new one per save, slots used again for loads. */
export class StateFiles {
  readonly #free: string[] = [];

  /** `keep`: load slots kept at most (the model's contexts); `buffers`: where saved states are read into. */
  constructor(
    readonly dir: string,
    readonly keep: number,
    readonly buffers: StateBuffers,
  ) {}

  #take(): string {
    return this.#free.pop() ?? path.join(this.dir, `${randomUUID()}.state`);
  }

  #give(file: string): void {
    if (this.#free.length < this.keep) this.#free.push(file);
    else fs.rmSync(file, { force: true });
  }

  /** The sequence's state as llama.cpp saves it, in a buffer of `buffers` (the caller gives it back). */
  async save(seq: Nlc.LlamaContextSequence): Promise<Buffer> {
    const file = path.join(this.dir, `${randomUUID()}.saved`);
    try {
      await seq.saveStateToFile(file);
      return readInto(file, this.buffers);
    } finally {
      fs.rm(file, { force: true }, () => {});
    }
  }

  /**
   * Loads `state` into the (cleared) sequence. Throws KvRejected 'refused'
   * when llama.cpp refuses it: the caller throws that context away.
   */
  async load(seq: Nlc.LlamaContextSequence, state: Buffer): Promise<void> {
    const file = this.#take();
    try {
      writeOver(file, state);
      try {
        await seq.loadStateFromFile(file, { acceptRisk: true });
      } catch (e) {
        throw new KvRejected(`llama.cpp refused the KV state: ${(e as Error).message}`, 'refused');
      }
    } finally {
      this.#give(file);
    }
  }
}
