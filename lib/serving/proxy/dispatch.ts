// One request through the stages: the encoder (when configured and the
// request has images), then the KV handoff (prefill and decode), then the
// decode's answer on its way back. Multi-turn lives here: the conversation's
// previous turn is claimed for the prefill, and the decode's held turn is
// carried to the conversation's entry for the next one.
import { hasImages } from '../api/http';
import { PreciseRouting } from '../kv-index/precise';
import { type Conversations, carryTurn } from './conversations';
import type { HandedOff, KvHandoff } from './handoff';
import type { ProxyRequest, StageCaller, StageResult } from './stage-call';
import type { StageAnswer } from './transports/types';

export class Dispatch {
  readonly #calls: StageCaller;
  readonly #handoff: KvHandoff;
  readonly #conversations: Conversations;

  constructor(calls: StageCaller, handoff: KvHandoff, conversations: Conversations) {
    this.#calls = calls;
    this.#handoff = handoff;
    this.#conversations = conversations;
  }

  /** The decode's answer to the request (release() it once relayed). */
  async run(r: ProxyRequest): Promise<StageResult> {
    const carries = this.#handoff.carriesTurns;
    const turn = r.conversation !== undefined && carries ? this.#conversations.claim(r.conversation) : undefined;
    if (this.#calls.pools.encode.size > 0 && hasImages(r.body))
      await this.#calls.call(r, { stage: 'encode', body: { ...r.body, stream: false, max_tokens: 1 } });
    const dec = await this.#handoff.run(r, turn);
    if (carries) dec.answer = this.#carry(r, dec);
    return dec;
  }

  /** The decode's answer, keeping its held turn for the conversation (or freeing it) and saying what was reused. */
  #carry(r: ProxyRequest, dec: HandedOff): StageAnswer {
    const reused = dec.turn?.reused;
    return carryTurn(dec.answer, {
      conversation: r.conversation,
      conversations: this.#conversations,
      release: (id) =>
        id === undefined ? this.#calls.releaseRequest(dec.worker, r.requestId) : this.#calls.release(dec.worker, id),
      cut: r.signal,
      reuseSkipped: dec.turn?.skipped,
      annotate: PreciseRouting.annotation(r.affinity),
      // A miss reused nothing; a prefill that read the previous turn and does not say (vLLM's): not known.
      reusedTokens:
        typeof reused === 'number' ? reused : r.conversation !== undefined && !dec.turn?.named ? 0 : undefined,
    });
  }
}
