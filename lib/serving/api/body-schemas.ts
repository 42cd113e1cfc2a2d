// The request bodies' JSON Schemas, one per endpoint that takes a body. The
// files published in docs/ are the ones checked against (read from the
// package, compiled by ajv once per process as the proxy or a worker
// starts), so the docs cannot drift from what is served. ajv's first error
// becomes a 400: OpenAI's invalid_request_error naming the field (param),
// with the schema's own `x-error` text.
import * as fs from 'node:fs';
import * as path from 'node:path';
import Ajv, { type ErrorObject, type ValidateFunction } from 'ajv';
import { HttpError } from './http';

export class RequestError extends HttpError {
  constructor(
    status: number,
    message: string,
    /** The field at fault (OpenAI's error.param). */
    readonly param?: string,
    /** OpenAI's error.code: unsupported_parameter for a field not served. */
    code?: string,
  ) {
    super(status, message, 'invalid_request_error', {
      ...(param !== undefined ? { param } : {}),
      ...(code !== undefined ? { code } : {}),
    });
    this.name = 'RequestError';
  }
}

/** The endpoints' schemas, by name: docs/<name>.schema.json. */
export const BODY_SCHEMAS = [
  'completions-request',
  'chat-completions-request',
  'generate-request',
  'kv-release-request',
  'tokenize-request',
  'detokenize-request',
] as const;
export type BodySchemaName = (typeof BODY_SCHEMAS)[number];

/** The package's root (lib/serving in the sources, dist/lib/serving built). */
function packageRoot(): string {
  for (let dir = __dirname; ; dir = path.dirname(dir)) {
    if (fs.existsSync(path.join(dir, 'package.json')) && fs.existsSync(path.join(dir, 'docs'))) return dir;
    if (path.dirname(dir) === dir) throw new Error(`no package root with docs/ above ${__dirname}`);
  }
}

/** Where a schema's file is. */
export function bodySchemaPath(name: BodySchemaName): string {
  return path.join(packageRoot(), 'docs', `${name}.schema.json`);
}

let compiled: Map<BodySchemaName, ValidateFunction> | undefined;

/** Reads and compiles the schemas, once per process (the proxy and the workers call it as they start). */
export function compileBodySchemas(): void {
  validators();
}

function validators(): Map<BodySchemaName, ValidateFunction> {
  if (compiled) return compiled;
  // verbose: errors carry their schema, where x-error is read.
  const ajv = new Ajv({ allErrors: false, verbose: true, strict: true, strictTypes: false });
  ajv.addKeyword({ keyword: 'x-error', schemaType: ['string', 'object'] });
  const m = new Map<BodySchemaName, ValidateFunction>();
  for (const name of BODY_SCHEMAS) m.set(name, ajv.compile(JSON.parse(fs.readFileSync(bodySchemaPath(name), 'utf8'))));
  compiled = m;
  return m;
}

/** The schema `name`'s body is checked against, as compiled (for the house test: it is the docs file). */
export function bodySchema(name: BodySchemaName): unknown {
  return validators().get(name)!.schema;
}

/** '/messages/0/content' -> 'messages[0].content' (OpenAI's param). */
function paramOf(pointer: string): string {
  let out = '';
  for (const raw of pointer.split('/').slice(1)) {
    const k = raw.replace(/~1/g, '/').replace(/~0/g, '~');
    out += /^\d+$/.test(k) ? `[${k}]` : out === '' ? k : `.${k}`;
  }
  return out;
}

type Schema = Record<string, unknown> & { 'x-error'?: string | Record<string, string> };

function textOf(s: Schema | undefined, keyword: string): string | undefined {
  const x = s?.['x-error'];
  return typeof x === 'string' ? x : x?.[keyword];
}

/** The error to answer: the deepest field whose schema says what it must be (the last of them at that depth). */
function answerOf(errors: ErrorObject[]): { param: string; text: string } | undefined {
  let best: { param: string; text: string; depth: number } | undefined;
  for (const e of errors) {
    let pointer = e.instancePath;
    let text: string | undefined;
    if (e.keyword === 'required') {
      const missing = (e.params as { missingProperty: string }).missingProperty;
      pointer += `/${missing.replace(/~/g, '~0').replace(/\//g, '~1')}`;
      const props = (e.parentSchema as Schema | undefined)?.properties as Record<string, Schema> | undefined;
      text = textOf(props?.[missing], 'required') ?? textOf(props?.[missing], 'type') ?? 'is required';
    } else text = textOf(e.parentSchema as Schema | undefined, e.keyword);
    if (text === undefined) continue;
    const depth = pointer.split('/').length;
    if (!best || depth >= best.depth) best = { param: paramOf(pointer), text, depth };
  }
  return best;
}

/** Throws RequestError (400) naming the first field of `body` that its endpoint's schema refuses. */
export function checkBody(name: BodySchemaName, body: unknown): void {
  const validate = validators().get(name)!;
  if (validate(body)) return;
  const errors = validate.errors ?? [];
  const a = answerOf(errors);
  if (a) throw new RequestError(400, `'${a.param}' ${a.text}`, a.param);
  const e = errors[0];
  const param = e ? paramOf(e.instancePath) : '';
  throw new RequestError(400, `'${param || 'body'}' ${e?.message ?? 'is not valid'}`, param || undefined);
}
