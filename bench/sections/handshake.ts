import * as fs from 'node:fs';
import { makeCerts } from '../certs';
import { benchHandshake } from '../handshake';
import type { Section } from './section';

export const handshake: Section = {
  name: 'handshake',
  title: 'side-channel fetches over ZeroMQ, HTTP and HTTPS against the raw transport',
  byDefault: true,
  async run({ quick, table }) {
    const n = quick ? 50 : 300;
    console.log(
      `\n# Handshake latency, ${n} fetches of one rank's payload (64 regions, 4 KiB agent metadata); ratio = median / raw transport median`,
    );
    let certs: ReturnType<typeof makeCerts> | undefined;
    try {
      certs = makeCerts();
    } catch {
      console.log('(openssl not found: https rows skipped)');
    }
    const hs = await benchHandshake(n, certs && { cert: certs.serverCert, key: certs.serverKey, ca: certs.ca });
    if (certs) fs.rmSync(certs.dir, { recursive: true, force: true });
    table(
      ['method', 'median ms', 'p99 ms', 'raw median ms', 'raw p99 ms', 'ratio'],
      hs.map((r) => [r.method, r.medianMs, r.p99Ms, r.rawMedianMs, r.rawP99Ms, r.ratio]),
    );
    return {
      json: { handshake: hs },
      panels: [
        {
          title: 'Handshake median / raw transport median',
          reference: 1,
          bars: hs.map((r) => ({ label: r.method, value: r.ratio })),
        },
      ],
    };
  },
};
