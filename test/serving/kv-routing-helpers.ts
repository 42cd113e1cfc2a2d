// Shared by the precise-routing tests: a completion through the proxy that
// answers 200 and says which prefill served it and how much prefix it matched.
import { expect } from 'vitest';
import type { ServingProxy } from '../../lib/serving/proxy/proxy';

export async function complete(proxy: ServingProxy, prompt: string) {
  const r = await fetch(`${proxy.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'nixl-node/synthetic', prompt, max_tokens: 2 }),
  });
  expect(r.status).toBe(200);
  return (await r.json()) as { nixl_node: { prefill: string; prefix_match_tokens: number } };
}
