import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    // Compiles lib/ cli/ demo/ bench/ to dist/ once per run: fixtures load it.
    globalSetup: ['test/global-setup.ts'],
    // Native threads + child processes: forks isolate a crash to one file.
    pool: 'forks',
    testTimeout: 30_000,
    hookTimeout: 60_000,
  },
});
