// What the agent's constructor and metadata calls decide before the addon
// sees them: the engine, a backend's parameters, a metadata server label.
import { invalidParam } from '../errors';
import { binding } from '../native';
import { ucxBackendParams } from '../ucx';
import type { EngineKind } from './types';

/** The engines compiled into this build of the addon: 'loopback', and 'nixl' when NIXL was found at build time. */
export const engines: readonly string[] = binding.engines;

export function defaultEngine(): EngineKind {
  const env = process.env.NIXL_NODE_ENGINE;
  if (env === 'nixl' || env === 'loopback') return env;
  if (env) throw invalidParam(`NIXL_NODE_ENGINE='${env}': expected 'nixl' or 'loopback'`);
  // Without NIXL the loopback engine is the default, silently: a library
  // writes nothing on its own (`nixl-node info` says which engines there are).
  return binding.engines.includes('nixl') ? 'nixl' : 'loopback';
}

/**
 * The params a backend is created with: the caller's, plus what NIXL's UCX
 * plugin needs to start under this process's UCX_TLS (ucx.ts) unless the
 * caller said otherwise.
 */
export function backendParams(
  engine: EngineKind,
  backend: string,
  given: Record<string, string> | undefined,
): Record<string, string> {
  const params = { ...(given ?? {}) };
  if (engine === 'nixl' && backend === 'UCX' && params.ucx_error_handling_mode === undefined)
    Object.assign(params, ucxBackendParams());
  return params;
}

/** A metadata server key's label: a non-empty string without NUL or '/' (it is the last part of the key), or undefined. */
export function metadataLabel(label: unknown): string | undefined {
  if (label === undefined) return undefined;
  if (typeof label !== 'string' || label === '' || label.length > 256 || /[\0/]/.test(label))
    throw invalidParam(
      `label must be 1-256 characters without '/' or NUL, got ${typeof label === 'string' ? JSON.stringify(label.slice(0, 64)) : typeof label}`,
    );
  return label;
}
