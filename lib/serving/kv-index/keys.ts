// The keys the proxy's block index gives blocks: its own chain over token
// ids (as llm-d does), so the index works whatever hash a publisher uses.

/** The key of a block: a 53-bit chain over the parent's key and the block's token ids. */
export function blockKey(parent: number, tokens: ArrayLike<number>, from: number, to: number): number {
  let h1 = (0xdeadbeef ^ parent) >>> 0;
  let h2 = (0x41c6ce57 ^ Math.floor(parent / 0x100000000)) >>> 0;
  for (let i = from; i < to; i++) {
    const t = tokens[i];
    h1 = Math.imul(h1 ^ t, 2654435761);
    h2 = Math.imul(h2 ^ t, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507);
  h1 ^= Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507);
  h2 ^= Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return 4294967296 * (2097151 & h2) + (h1 >>> 0);
}

/** The chain's first parent: the LoRA adapter (or none) starts its own chain. */
export function rootKey(lora: string | null = null): number {
  if (lora === null) return 0;
  const b = Buffer.from(lora, 'utf8');
  return blockKey(1, b, 0, b.length);
}

/** The keys of a prompt's full blocks, in order. */
export function promptKeys(tokens: ArrayLike<number>, blockSize: number, lora: string | null = null): number[] {
  const keys: number[] = [];
  let parent = rootKey(lora);
  for (let i = 0; i + blockSize <= tokens.length; i += blockSize) {
    parent = blockKey(parent, tokens, i, i + blockSize);
    keys.push(parent);
  }
  return keys;
}
