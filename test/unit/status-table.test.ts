// The status table comes from the nixl_types.h the addon is built against
// (scripts/gen-status-table.js): codes this release does not list still
// become NixlErrors named as that NIXL names them. The headers here are
// fixtures written by the test, not NIXL's own.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { NixlError, Status } from '../../lib/errors';
import { binding } from '../../lib/native';
import { statusTable, useStatusTable } from '../../lib/status-table';
import { ROOT } from '../helpers';

const script = path.join(ROOT, 'scripts', 'gen-status-table.js');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'nixl-status-'));
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

const FIXTURE = `#pragma once
/** @enum nixl_status_t */
enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2, // trailing comment
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
    /**
     * @brief Posted transfer exceeded the stall timeout.
     */
    NIXL_ERR_XFER_STALLED = -13,
    NIXL_ERR_FROM_THE_FUTURE = -14
};
`;

function generate(header: string): Record<string, number> {
  const file = path.join(dir, `${path.basename(header)}.h`);
  fs.writeFileSync(file, header === 'fixture' ? FIXTURE : header);
  const out = execFileSync(process.execPath, [script, '--header', file, '--out', dir, '--json'], { encoding: 'utf8' });
  return JSON.parse(out);
}

it('codes a header adds (a stall timeout, one unknown to this release) become typed NixlErrors with their names', () => {
  const codes = generate('fixture');
  expect(codes).toMatchObject({ NIXL_ERR_XFER_STALLED: -13, NIXL_ERR_FROM_THE_FUTURE: -14, NIXL_SUCCESS: 0 });
  // The header the addon build includes, with a test macro per code.
  const h = fs.readFileSync(path.join(dir, 'nixl_node_status_table.h'), 'utf8');
  expect(h).toContain('X(NIXL_ERR_FROM_THE_FUTURE, -14)');
  expect(h).toContain('#define NIXL_NODE_HAS_NIXL_ERR_XFER_STALLED 1');

  const before = NixlError.fromStatus(-14, 'x');
  expect(before.code).toBe('NIXL_ERR_UNKNOWN');
  expect(before.status).toBe(-14);
  const saved = statusTable();
  try {
    useStatusTable(codes, 'fixture');
    for (const [status, code] of [
      [-13, 'NIXL_ERR_XFER_STALLED'],
      [-14, 'NIXL_ERR_FROM_THE_FUTURE'],
      [-4, 'NIXL_ERR_NOT_FOUND'],
    ] as const) {
      const e = NixlError.fromStatus(status, 'from the engine');
      expect(e).toBeInstanceOf(NixlError);
      expect(e.code).toBe(code);
      expect(e.status).toBe(status);
      // And by name, as the library raises it.
      expect(new NixlError('m', code).status).toBe(status);
    }
    // A number no table has: NIXL_ERR_UNKNOWN, the number kept.
    expect(NixlError.fromStatus(-99, 'm')).toMatchObject({ code: 'NIXL_ERR_UNKNOWN', status: -99 });
  } finally {
    useStatusTable(saved.codes, saved.source);
  }
});

it('a header that claims one number for two codes, or that has no status enum, fails the build with the reason', () => {
  const clash = FIXTURE.replace('NIXL_ERR_FROM_THE_FUTURE = -14', 'NIXL_IN_PROG_WITH_ERR = -13');
  expect(() => generate(clash)).toThrow(/NIXL_IN_PROG_WITH_ERR and NIXL_ERR_XFER_STALLED are both -13/);
  expect(() => generate('enum other_t { A = 1 };')).toThrow(/no enum nixl_status_t/);
});

it('the addon carries the table it was built with; without NIXL, the checked-in one (NIXL 1.4.0)', () => {
  const { codes } = statusTable();
  for (const [name, value] of Object.entries(binding.statusCodes)) expect(codes[name]).toBe(value);
  for (const [name, value] of Object.entries(Status)) expect(binding.statusCodes[name]).toBe(value);
  if (!binding.engines.includes('nixl')) {
    expect(binding.statusSource).toMatch(/^NIXL 1\.4\.0/);
    const fallback = fs.readFileSync(path.join(ROOT, 'native', 'generated', 'nixl_node_status_table.h'), 'utf8');
    expect(Object.keys(binding.statusCodes).length).toBe((fallback.match(/^ {2}X\(/gm) ?? []).length);
  }
});
