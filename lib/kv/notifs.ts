// One loop that takes the notifications one listener claims. Several
// listeners share an agent (a prefill's tracker, a push sender, a push
// receiver): each claims only what `match` says is its own, and the rest stay
// queued on the agent for the others.
import type { NixlAgent, Notif } from '../agent';

/**
 * Hands every notification `match` claims to `onNotif`, one at a time, until
 * `signal` aborts or the agent closes; the promise resolves then. @internal
 */
export async function listenNotifs(
  agent: NixlAgent,
  match: (n: Notif) => boolean,
  onNotif: (n: Notif) => void,
  signal: AbortSignal,
): Promise<void> {
  while (!signal.aborted) {
    let n: Notif;
    try {
      n = await agent.waitForNotif(match, { signal });
    } catch {
      return; // aborted, or the agent closed
    }
    onNotif(n);
  }
}
