// The prefix bench's prompts (bench/fleet-gguf.ts): every policy gets prompts
// of the same length (the 'small' model tokenizes byte by byte, so characters
// are tokens), from prefixes of its own that no other policy's prompt shares
// a block of, so that no policy's cache helps another and none evaluates more.
import { expect, it } from 'vitest';
import { POLICIES, promptOf } from '../../bench/fleet-gguf';

function common(a: string, b: string): number {
  let n = 0;
  while (n < a.length && a[n] === b[n]) n++;
  return n;
}

it('request i of a run is as long for every policy, and no two policies share 16 leading characters', () => {
  for (let r = 0; r < 3; r++)
    for (let i = 0; i < 36; i++) {
      const prompts = POLICIES.map((_, j) => promptOf(r, j, i));
      expect(new Set(prompts.map((p) => p.length)).size).toBe(1);
      for (let j = 1; j < prompts.length; j++) expect(common(prompts[0], prompts[j])).toBeLessThan(16);
    }
});

it("a policy's requests from the same prefix share it up to the question; other runs share nothing", () => {
  const a = promptOf(0, 2, 0);
  const same = Array.from({ length: 36 }, (_, i) => promptOf(0, 2, i)).filter((p, i) => i > 0 && p[0] === a[0]);
  expect(same.length).toBeGreaterThan(0);
  for (const p of same) expect(common(a, p)).toBe(a.indexOf(' Question') + ' Question '.length);
  expect(common(a, promptOf(1, 2, 0))).toBeLessThan(16);
});
