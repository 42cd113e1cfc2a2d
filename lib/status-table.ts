// The status codes of the NIXL that the addon was built against: the build
// reads them from the installed nixl_types.h (scripts/gen-status-table.js; a
// checked-in table of NIXL 1.4.0 without NIXL) and the addon hands them over
// at load (lib/native.ts). A code that lib/errors.ts does not list, added by
// a newer NIXL, still becomes a NixlError named as that NIXL names it; a
// number no table knows becomes NIXL_ERR_UNKNOWN with the number kept.
// Pure: no addon needed.

const byValue = new Map<number, string>();
const byName = new Map<string, number>();
let tableSource = 'lib/errors.ts (NIXL 1.4.0)';

/** Makes these codes (name -> nixl_status_t value) the ones errors are named by; later tables win. */
export function useStatusTable(codes: Readonly<Record<string, number>>, source?: string): void {
  for (const [name, value] of Object.entries(codes)) {
    if (!/^NIXL_[A-Z0-9_]+$/.test(name) || !Number.isInteger(value)) continue;
    const old = byValue.get(value);
    if (old !== undefined && old !== name) byName.delete(old);
    byValue.set(value, name);
    byName.set(name, value);
  }
  if (source) tableSource = source;
}

/** The name of a status number in the table in use, if it has one. */
export function statusName(status: number): string | undefined {
  return byValue.get(status);
}

/** The number of a status name in the table in use, if it has one. */
export function statusValue(name: string): number | undefined {
  return byName.get(name);
}

/** The table in use: name -> value, and where it came from. */
export function statusTable(): { codes: Record<string, number>; source: string } {
  return { codes: Object.fromEntries(byName), source: tableSource };
}
