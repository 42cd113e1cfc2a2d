// The request bodies' JSON Schemas published in docs/ are the ones the
// proxy and the workers check against: each route that takes a body names
// one, each is the docs file as compiled, none is left over, and the package
// and the serving docs carry them.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { expect, it } from 'vitest';
import { BODY_SCHEMAS, bodySchema, bodySchemaPath } from '../../lib/serving/api/body-schemas';
import { PROXY_ROUTES, WORKER_ROUTES } from '../../lib/serving/api/routes';

const ROOT = path.join(__dirname, '..', '..');
const published = fs
  .readdirSync(path.join(ROOT, 'docs'))
  .filter((f) => f.endsWith('-request.schema.json'))
  .map((f) => f.replace(/\.schema\.json$/, ''))
  .sort();

it('each body schema checked is the docs file, as it is published', () => {
  expect([...BODY_SCHEMAS].sort()).toEqual(published);
  for (const name of BODY_SCHEMAS) {
    const file = path.join(ROOT, 'docs', `${name}.schema.json`);
    expect(bodySchemaPath(name)).toBe(file);
    expect(bodySchema(name)).toEqual(JSON.parse(fs.readFileSync(file, 'utf8')));
    expect((bodySchema(name) as { $id: string }).$id.endsWith(`/docs/${name}.schema.json`)).toBe(true);
  }
});

it("every POST route names its body schema, and every schema is some route's", () => {
  const named = new Set<string>();
  for (const table of [WORKER_ROUTES, PROXY_ROUTES])
    for (const [p, r] of table) {
      expect(r.methods.includes('POST'), p).toBe(r.body !== undefined);
      if (r.body) named.add(r.body);
    }
  expect([...named].sort()).toEqual(published);
});

it('the package ships them and docs/serving.md names each', () => {
  const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'));
  expect(pkg.files).toContain('docs/*.json');
  expect(pkg.dependencies.ajv).toMatch(/^\d+\.\d+\.\d+$/);
  const page = fs.readFileSync(path.join(ROOT, 'docs', 'serving.md'), 'utf8');
  for (const name of BODY_SCHEMAS) expect(page, name).toContain(`${name}.schema.json`);
});
