// Tests run compiled code in child processes (fixtures, the CLI): compile the
// TypeScript first, so that `npx vitest run <file>` on a fresh `npm install`
// tests the sources as they are, not a dist/ that is missing or stale (what
// tsc once emitted for a source since moved or removed is pruned first).
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import { prune } from '../scripts/prune-dist.js';

export default function setup(): void {
  const root = path.join(__dirname, '..');
  prune(root);
  execFileSync(process.execPath, [path.join(root, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', 'tsconfig.json'], {
    cwd: root,
    stdio: 'inherit',
  });
}
