// The house: the command (cli/) on top, then demo/ and bench/, then lib/;
// nothing imports a folder on a floor above its own (demo and bench once
// imported cli/args.ts while the CLI ran them).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
const ROOT = path.join(__dirname, '..');

const FLOOR: Record<string, number> = { cli: 3, demo: 2, bench: 2, lib: 1 };

function sources(dir: string): string[] {
  return fs
    .readdirSync(path.join(ROOT, dir), { recursive: true, encoding: 'utf8' })
    .filter((f) => f.endsWith('.ts'))
    .map((f) => path.join(dir, f));
}

it('no import runs to a floor above: cli -> demo, bench -> lib', () => {
  const wrong: string[] = [];
  let seen = 0;
  for (const file of Object.keys(FLOOR).flatMap(sources)) {
    const from = file.split(path.sep)[0];
    const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
    for (const m of text.matchAll(/(?:from\s+|import\()\s*'(\.[^']+)'/g)) {
      seen++;
      const target = path.relative(ROOT, path.resolve(ROOT, path.dirname(file), m[1])).split(path.sep)[0];
      if (!(target in FLOOR)) wrong.push(`${file} imports ${m[1]} (outside the floors)`);
      else if (FLOOR[target] > FLOOR[from]) wrong.push(`${file} (${from}) imports ${m[1]} (${target}, a floor above)`);
    }
  }
  expect(seen).toBeGreaterThan(100);
  expect(wrong).toEqual([]);
});
