// The Agent API (reading path: agent.ts, the class that mirrors NIXL's agent;
// types.ts, what its calls take and return; then the parts it is built from:
// waits.ts and notifs.ts, what settles a promise; inline-budget.ts, how much
// inline work a turn of the event loop may do; layered-xfer.ts, the
// layer-wise request).
export { NixlAgent } from './agent';
export { engines } from './config';
export { LayeredXferHandle } from './layered-xfer';
export {
  DEFAULT_INLINE_POST_MAX_BYTES,
  DEFAULT_INLINE_POST_MAX_US,
  DlistHandle,
  RegisteredMemory,
  XferHandle,
} from './types';
export type {
  AgentOptions,
  BackendParams,
  EngineKind,
  Notif,
  NotifMsg,
  WaitOptions,
  XferOp,
  XferOptions,
  XferState,
} from './types';
