// The native baseline the bench and the demo hold the binding against
// (bench/native/nixl_read.cpp, built on an installed NIXL): it must finish
// in each progress mode the binding offers. Without NIXL's progress thread,
// its last notification moves only when the program itself progresses.
import { spawnSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { nativeProgram } from '../../lib/native-program';

const prog = nativeProgram();
const skip = 'skip' in prog ? prog.skip : undefined;

describe.skipIf(skip !== undefined)(`nixl_read${skip ? ` (skipped: ${skip})` : ''}`, () => {
  for (const flags of [[], ['--no-progress-thread']])
    it(`one READ job ${flags.join(' ') || 'with the progress thread'}: a JSON line, then exit 0`, () => {
      const r = spawnSync(
        (prog as { path: string }).path,
        ['--block', '65536', '--count', '64', '--reps', '2', ...flags],
        { encoding: 'utf8', timeout: 60_000 },
      );
      expect(r.signal, `stderr: ${r.stderr}`).toBeNull();
      expect(r.status, `stderr: ${r.stderr}`).toBe(0);
      const line = JSON.parse(r.stdout.trim().split('\n').at(-1) ?? '{}');
      expect(line.gbps).toBeGreaterThan(0);
    }, 90_000);
});
